#!/bin/bash
# The staged demo five times in a row, then every fault drill, staged and direct (one NVIDIA H200), nothing exported
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd):/tmp/site
B="--no-progress --engine nixl --preset llama70b-tp8-p64 --layers 4 --requests 4 --prompt-len 4096"
for i in 1 2 3 4 5; do echo "== staged $i ($SECONDS s)"; timeout 30 python3 -m kvplan demo $B --mode staged --repeat 8 2>&1 | grep -E "first batch|steady|completed|verification|result"; done
for mode in staged direct; do
  for f in dead-decode dead-prefill dead-decode-mid dead-prefill-mid bad-registration deadline; do
    echo "== drill $mode $f ($SECONDS s)"; timeout 25 python3 -m kvplan demo $B --mode $mode --fault $f 2>&1 | grep -E "fault|observed|expected" | tail -2
  done
done
echo "== end ($SECONDS s)"
