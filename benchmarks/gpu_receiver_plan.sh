#!/usr/bin/env bash
# Staged mode through NIXL on one GPU, the receiver-planned scatter against destination tables, alternating
# on one machine; then a traced run of each, then byte-verified staged hand-offs of every preset.
# Usage on the GPU machine (NIXL and pyzmq wheels carried in .whl):
#   OUT=/some/dir bash benchmarks/gpu_receiver_plan.sh "MIB:SLOTS ..."     (default: 512:1 256:2 512:1 64:4)
# EXTRA: flags for every demo (e.g. --decode-gpu 1 on two cards); QUICK=1 skips the other presets;
# TRACE: the configurations traced (default: 512:1 64:4).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" .whl
log="$OUT/receiver-plan.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$log"
echo "cpus: nproc $(nproc), $(grep -m1 "model name" /proc/cpuinfo), load $(cut -d" " -f1-3 /proc/loadavg)" | tee -a "$log"
demo() {
  echo "\$ kvplan demo --engine nixl $* ${EXTRA:-}" | tee -a "$log"
  timeout 300 python3 -m kvplan demo --no-progress --engine nixl "$@" ${EXTRA:-} 2>&1 | tee -a "$log"
}
big="--preset llama70b-tp8-p64 --layers 8 --requests 8 --prompt-len 8192"
for one in ${1:-512:1 256:2 512:1 64:4}; do
  mib=${one%%:*}; slots=${one##*:}
  demo $big --mode staged --staging-mib "$mib" --staging-slots "$slots" --repeat 12
  demo $big --mode staged --staging-mib "$mib" --staging-slots "$slots" --repeat 12 --scatter-tables
done
demo $big --mode auto --staging-mib 512 --staging-slots 1 --repeat 12
for one in ${TRACE:-512:1 64:4}; do
  for extra in "" "--scatter-tables"; do
    echo "\$ traced: staged $one $extra --repeat 5" >> "$log"
    KVPLAN_TRACE=1 timeout 300 python3 -m kvplan demo --no-progress --engine nixl $big --mode staged --staging-mib \
      ${one%%:*} --staging-slots ${one##*:} --repeat 5 $extra ${EXTRA:-} 2>&1 | grep "waves" >> "$log"
  done
done
[ -n "${QUICK:-}" ] && exit 0
for preset in gptoss-swa-p16 qwen3next-mamba-p64 dsv32-mla-dsa-p64; do
  demo --preset $preset --layers 8 --requests 8 --prompt-len 4096 --mode staged --staging-mib 256 --staging-slots 2 --repeat 6
done
demo $big --mode staged --staging-mib 512 --staging-slots 1 --repeat 6 --dst-page-size 16
