#!/usr/bin/env bash
# Staged mode through NIXL on one GPU: steady throughput, then a traced run (per-wave steps on the
# shared clock of both processes), optionally profiled (PROFILE=1).
# Usage on the GPU machine (NIXL and pyzmq wheels carried in .whl):
#   OUT=/some/dir bash benchmarks/gpu_staged.sh "MIB:SLOTS ..."     (default: 64:4 256:4 256:2)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" .whl
log="$OUT/staged.txt"
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$log"
echo "cpus: nproc $(nproc), cgroup cpu.max $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo n/a), $(grep -m1 "model name" /proc/cpuinfo), load $(cut -d" " -f1-3 /proc/loadavg)" | tee -a "$log"
demo() {
  timeout 300 python3 -m kvplan demo --no-progress --engine nixl --preset llama70b-tp8-p64 --layers 8 --requests 8 \
    --prompt-len 8192 ${EXTRA:-} "$@"
}
for one in ${1:-64:4 256:4 256:2}; do
  mib=${one%%:*}; slots=${one##*:}
  echo "\$ kvplan demo --mode ${MODE:-staged} --staging-mib $mib --staging-slots $slots ${EXTRA:-} --repeat 12" | tee -a "$log"
  demo --mode "${MODE:-staged}" --staging-mib "$mib" --staging-slots "$slots" --repeat 12 2>&1 | tee -a "$log"
  echo "\$ the same, traced, --repeat 4" >> "$log"
  KVPLAN_TRACE=1 demo --mode "${MODE:-staged}" --staging-mib "$mib" --staging-slots "$slots" --repeat 4 2>&1 \
    | grep "waves" >> "$log"
  if [ -n "${PROFILE:-}" ]; then
    rm -rf /tmp/prof
    KVPLAN_PROFILE=/tmp/prof demo --mode "${MODE:-staged}" --staging-mib "$mib" --staging-slots "$slots" --repeat 12 >/dev/null 2>&1
    for side in prefill decode; do echo "== $side profile"; head -50 /tmp/prof/$side.txt; done >> "$log"
  fi
done
