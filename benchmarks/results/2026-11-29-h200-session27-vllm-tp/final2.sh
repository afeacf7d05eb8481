#!/bin/bash
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo NIXL_LOG_LEVEL=WARN PYTHONPATH=$ROOT:/tmp/site
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
mkdir -p $OUT/r
timeout 200 python3 -m benchmarks.vllm_shapes --batches 16x5k 4x32k --no-plan --tp 8 4 --modes staged --placements fragmented --repeats 3 --out $OUT/r 2>&1 | tee $OUT/r/vllm-tp8to4.txt | grep -E "^move|Error|rror:"
