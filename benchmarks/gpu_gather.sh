#!/usr/bin/env bash
# TP gather on two cards (issue 11's fan-in, docs/tp_state.md §4): kvplan demo --gather with one
# prefill process per source rank of the decode rank's group, all on GPU 0, the decode on GPU 1,
# through NIXL (nixl_cu13 and pyzmq wheels carried in .whl); every byte verified.
# Usage on a two-GPU machine:  OUT=/some/dir bash benchmarks/gpu_gather.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" .whl
for args in "--preset qwen3next-mamba-p64 --layers 12 --mode auto" "--preset qwen3next-mamba-p64 --layers 12 --mode staged" \
            "--preset qwen3next-mamba-p64 --layers 12 --mode direct" "--preset llama70b-tp8-p64 --layers 8 --mode staged"; do
  cmd="kvplan demo --engine nixl --requests 8 --prompt-len 4096 --src-tp 8 --dst-tp 4 --gather --decode-gpu 1 --repeat 4 $args"
  echo "\$ $cmd" | tee -a "$OUT/gather.txt"
  timeout 120 python3 -m $cmd --no-progress --timeout 60 2>&1 | tail -12 | tee -a "$OUT/gather.txt"
done
