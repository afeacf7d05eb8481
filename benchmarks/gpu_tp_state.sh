#!/usr/bin/env bash
# State between different TP sizes on one GPU (issue 16): the kernel and planner tests compiled for
# the card, the bench rows of the TP scenarios and their equal-TP twins, then kvplan demo with every
# preset between TP 4 and 8 (and 8 -> 4) through the engine whose wheels are carried (ENGINE=nixl,
# wheels in .whl; ENGINE=mooncake, wheels in .whl-mc). TESTS=0 skips the tests, BENCH=0 the bench.
# Usage on the GPU machine:  OUT=/some/dir ENGINE=nixl bash benchmarks/gpu_tp_state.sh
set -uo pipefail
ENGINE=${ENGINE:-nixl}
WHEELS=$([ "$ENGINE" = mooncake ] && echo .whl-mc || echo .whl)
source "$(dirname "$0")/gpu_env.sh" "$WHEELS"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/card.txt"
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/planner tests/kernels tests/transport/test_local.py \
    tests/tools/test_baseline.py 2>&1 | tee "$OUT/tests.log" | tail -15
fi
if [ "${BENCH:-1}" = 1 ]; then
  python3 -m kvplan bench --no-progress --json "$OUT/bench.json" --scenario qwen3next-mamba-p64 \
    --scenario qwen3next-mamba-tp4to8-p64 --scenario gptoss-swa-p16 --scenario gptoss-swa-tp4to8-p16 \
    --scenario llama70b-tp4to8-p64 2>&1 | tee "$OUT/bench.md"
fi
for args in "--preset qwen3next-mamba-p64 --src-tp 4 --dst-tp 8 --layers 12 --requests 8 --prompt-len 4096" \
            "--preset qwen3next-mamba-p64 --src-tp 4 --dst-tp 8 --layers 12 --requests 8 --prompt-len 4096 --mode staged" \
            "--preset qwen3next-mamba-p64 --src-tp 8 --dst-tp 4 --layers 12 --requests 8 --prompt-len 4096" \
            "--preset gptoss-swa-p16 --src-tp 4 --dst-tp 8" \
            "--preset dsv32-mla-dsa-p64 --src-tp 4 --dst-tp 8"; do
  echo "\$ kvplan demo --engine $ENGINE $args" | tee -a "$OUT/demo.txt"
  timeout 300 python3 -m kvplan demo --no-progress --engine "$ENGINE" $args 2>&1 | tee -a "$OUT/demo.txt"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/demo.txt"
done
