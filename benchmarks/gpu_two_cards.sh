#!/usr/bin/env bash
# Two GPUs of one host through NIXL: prefill pools on GPU 0, decode pools on GPU 1, two processes.
# The engine's one-write ceiling between the cards, then kvplan demo staged, auto and direct.
# Usage on a two-GPU machine (NIXL and pyzmq wheels carried in .whl):  OUT=/some/dir bash benchmarks/gpu_two_cards.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" .whl
log="$OUT/two-cards.txt"
nvidia-smi --query-gpu=index,name --format=csv,noheader | tee "$log"
nvidia-smi topo -m 2>&1 | head -4 | tee -a "$log"
python3 -m benchmarks.engine_ceiling nixl 256 1 2>&1 | grep -v INFO | tee -a "$log"
for args in "--mode staged --staging-mib 512 --staging-slots 1" "--mode staged --staging-mib 256 --staging-slots 4" \
            "--mode auto --staging-mib 512 --staging-slots 2" "--mode direct"; do
  echo "\$ kvplan demo --decode-gpu 1 $args --preset llama70b-tp8-p64 --layers 8 --requests 8 --prompt-len 8192 --repeat 12" | tee -a "$log"
  timeout 300 python3 -m kvplan demo --no-progress --engine nixl --decode-gpu 1 $args --preset llama70b-tp8-p64 \
    --layers 8 --requests 8 --prompt-len 8192 --repeat 12 2>&1 | tee -a "$log"
done
