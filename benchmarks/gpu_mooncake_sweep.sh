#!/usr/bin/env bash
# Mooncake's TCP settings against kvplan's direct and staged modes (issue 11), on one machine: for each
# setting given (a space-separated list of VAR=value, one argument per setting), the one-write ceiling,
# the same bytes as 6,832 descriptors in one write (the demo batch's count), and kvplan demo direct (and
# staged, with STAGED=1) on the issue-11 batch. Wheels carried in .whl-mc.
# Usage on the GPU machine:  OUT=/some/dir bash benchmarks/gpu_mooncake_sweep.sh "MC_TCP_LANES_PER_PEER=4" ...
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" .whl-mc
log="$OUT/mooncake-sweep.txt"
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$log"
quiet() { grep -vE "^[IEW][0-9]{4} "; }
demo() {
  echo "\$ $1 kvplan demo --engine mooncake $2 --preset llama70b-tp8-p64 --layers 8 --requests 8 --prompt-len 8192 --repeat 8" | tee -a "$log"
  env $1 timeout 240 python3 -m kvplan demo --no-progress --engine mooncake $2 --preset llama70b-tp8-p64 --layers 8 \
    --requests 8 --prompt-len 8192 --repeat 8 2>&1 | quiet | grep -E "steady|first batch|result|Error" | tee -a "$log"
}
for setting in "$@"; do
  echo "== $setting" | tee -a "$log"
  env $setting timeout 120 python3 -m benchmarks.engine_ceiling mooncake 256 0 1 2>&1 | quiet | grep ceiling | tee -a "$log"
  env $setting timeout 120 python3 -m benchmarks.engine_ceiling mooncake 256 0 6832 2>&1 | quiet | grep ceiling | tee -a "$log"
  demo "$setting" "--mode direct"
  [ "${STAGED:-0}" = 1 ] && demo "$setting" "--mode staged --staging-mib 512 --staging-slots 1"
done
