#!/bin/bash
# Session 28's device calls (one NVIDIA H200 each), the parts in order: `bash run.sh 1`, then 2, then 3.
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo NIXL_LOG_LEVEL=WARN PYTHONPATH=$ROOT:/tmp/site
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
mkdir -p $OUT/r
shapes() {  # the vLLM-shaped transfer benchmark, fragmented blocks, 3 rounds; $1: its limit in seconds
    local limit=$1; shift
    timeout $limit python3 -m benchmarks.vllm_shapes --no-plan --placements fragmented --repeats 3 --out $OUT/r "$@" 2>&1 | grep -E "^move|Error|error|did not"
}
case "$1" in
1)  # the kernels and planner tests compiled, the changed transport tests, the planning table, TP 4 -> 8 16x5k
    KVPLAN_TEST_ENGINES=nixl timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/planner tests/kernels \
        tests/transport/test_nixl_lists.py > $OUT/r/gpu-tests.txt 2>&1; tail -3 $OUT/r/gpu-tests.txt
    timeout 120 python3 -m benchmarks.vllm_shapes --no-transfer --out $OUT/r 2>&1 | tee $OUT/r/vllm-plan.txt
    shapes 200 --batches 16x5k --tp 4 8 --layout LBHNC --modes prepared staged direct | tee $OUT/r/vllm-tp4to8-16x5k.txt ;;
2)  # TP 4 -> 8 4x32k in LBHNC (vLLM's NIXL connector's layout), and in LBNHC staged, the same run
    shapes 330 --batches 4x32k --tp 4 8 --layout LBHNC --modes prepared staged direct | tee $OUT/r/vllm-tp4to8-4x32k.txt
    shapes 200 --batches 16x5k 4x32k --tp 4 8 --layout LBNHC --modes staged | tee $OUT/r/vllm-tp4to8-lbnhc.txt ;;
3)  # TP 8 -> 4 (a gather) in LBHNC, and in LBNHC staged, the same run
    shapes 400 --batches 16x5k 4x32k --tp 8 4 --layout LBHNC --modes prepared staged | tee $OUT/r/vllm-tp8to4.txt
    shapes 150 --batches 16x5k 4x32k --tp 8 4 --layout LBNHC --modes staged | tee $OUT/r/vllm-tp8to4-lbnhc.txt ;;
4)  # the head-major and sliding-window planner tests compiled, the transport's hand-offs, a sliding-window group moved
    KVPLAN_TEST_ENGINES=nixl timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/planner/test_head_major.py \
        tests/planner/test_packed_heads.py tests/transport/test_engine_regions.py tests/transport/test_nixl_lists.py \
        tests/transport/test_handoff.py -k "not mooncake" > $OUT/r/gpu-tests-4.txt 2>&1; tail -3 $OUT/r/gpu-tests-4.txt
    shapes 330 --batches 16x5k 4x32k --window 128 --modes prepared staged | tee $OUT/r/vllm-window.txt ;;
5)  # the final tree: the transport's hand-offs, warm-up and gathers on the GPU (the engines' regions changed)
    KVPLAN_TEST_ENGINES=nixl timeout 420 python3 -m pytest -q -p no:cacheprovider -rfE tests/transport/test_handoff.py \
        tests/transport/test_warm_up.py tests/transport/test_gather.py -k "not mooncake" > $OUT/r/gpu-tests-5.txt 2>&1
    tail -4 $OUT/r/gpu-tests-5.txt ;;
esac
