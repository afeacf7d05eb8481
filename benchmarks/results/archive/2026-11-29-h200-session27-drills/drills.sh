#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo NIXL_LOG_LEVEL=WARN PYTHONPATH=$(pwd):/tmp/site
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
B="--no-progress --engine nixl --preset llama70b-tp8-p64 --layers 4 --requests 4 --prompt-len 4096 --mode staged"
for i in 1 2 3 4 5; do echo "== staged $i"; timeout 40 python3 -m kvplan demo $B --repeat 8 2>&1 | grep -E "first batch|steady|completed|verification|result"; done
for f in dead-decode dead-prefill dead-decode-mid dead-prefill-mid bad-registration deadline; do echo "== drill staged $f"; timeout 40 python3 -m kvplan demo $B --fault $f 2>&1 | grep -E "result|fault|observed|expected" | tail -3; done
