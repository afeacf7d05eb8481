#!/usr/bin/env bash
# End to end on a GPU through one engine (wheels carried in .whl for NIXL or .whl-mc for Mooncake):
# the engine's ceiling, then kvplan demo direct and staged on the same machine.
# Usage on the GPU machine:  OUT=/some/dir bash benchmarks/gpu_e2e.sh nixl|mooncake
set -uo pipefail
engine=$1
wheels=.whl; [ "$engine" = mooncake ] && wheels=.whl-mc
source "$(dirname "$0")/gpu_env.sh" "$wheels"
log="$OUT/e2e-$engine.txt"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$log"
python3 -m benchmarks.engine_ceiling "$engine" 256 2>&1 | tee -a "$log"
run() {
  echo "\$ kvplan demo --engine $engine $* --preset llama70b-tp8-p64 --layers 8 --requests 8 --prompt-len 8192 --repeat 12" | tee -a "$log"
  timeout 300 python3 -m kvplan demo --no-progress --engine "$engine" "$@" --preset llama70b-tp8-p64 --layers 8 \
    --requests 8 --prompt-len 8192 --repeat 12 2>&1 | tee -a "$log"
}
run --mode direct
[ "$engine" = nixl ] && run --mode direct --engine-threads 4
run --mode staged --staging-mib 512 --staging-slots 1
run --mode staged --staging-mib 256 --staging-slots 2
run --mode auto --staging-mib 512 --staging-slots 1
run --mode staged --staging-mib 512 --staging-slots 1 --dst-page-size 16
