#!/bin/bash
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo NIXL_LOG_LEVEL=WARN PYTHONPATH=$ROOT:/tmp/site
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
mkdir -p $OUT/r
timeout 150 python3 -m benchmarks.vllm_shapes --batches 16x5k 4x32k --no-plan --tp 4 8 --modes staged --placements fragmented --repeats 3 --out $OUT/r 2>&1 | tee $OUT/r/vllm-tp4to8.txt | grep -E "^move|Error|error" 
KVPLAN_TEST_ENGINES=nixl timeout 280 python3 -m pytest -q -p no:cacheprovider -rfE tests/planner/test_packed_heads.py tests/planner/test_pairing.py tests/transport/test_warm_up.py tests/transport/test_completion.py tests/transport/test_handoff.py -k "not mooncake and (staged or packed or pairing or decode_warm or completion or page_sizes or head)" > $OUT/r/gpu-tests.txt 2>&1; tail -4 $OUT/r/gpu-tests.txt

# the second call (another H200; the same set-up lines, then):
# timeout 200 python3 -m benchmarks.vllm_shapes --batches 16x5k 4x32k --no-plan --tp 8 4 --modes staged --placements fragmented --repeats 3 --out $OUT/r 2>&1 | tee $OUT/r/vllm-tp8to4.txt
