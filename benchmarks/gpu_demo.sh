#!/usr/bin/env bash
# kvplan demo on a GPU with VRAM pools through NIXL (nixl_cu13 and pyzmq wheels carried in .whl).
# Usage on the GPU machine:  OUT=/some/dir bash benchmarks/gpu_demo.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" .whl
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/demo.txt"
for args in "" "--mode staged" "--mode prepared" \
            "--preset llama70b-tp8-p64 --layers 8 --requests 8 --prompt-len 8192" \
            "--preset llama70b-tp8-p64 --layers 8 --requests 8 --prompt-len 8192 --mode staged" \
            "--preset llama70b-tp4to8-p64 --layers 8 --requests 4 --prompt-len 4096 --mode staged" \
            "--preset dsv32-mla-dsa-p64 --layers 8 --requests 8 --prompt-len 4096" \
            "--preset qwen3next-mamba-p64 --layers 12 --requests 8 --prompt-len 4096"; do
  echo "\$ kvplan demo $args" | tee -a "$OUT/demo.txt"
  python3 -m kvplan demo --no-progress $args 2>&1 | tee -a "$OUT/demo.txt"
done
