#!/usr/bin/env bash
# One GPU session: the kernel and planner tests compiled for the card, then every benchmark.
# Usage on the GPU machine:  OUT=/some/dir bash benchmarks/gpu_run.sh
set -uo pipefail
export PYTHONPATH=. TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kvplan-gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/card.txt"
python3 -m pytest -q -p no:cacheprovider tests/planner tests/compat tests/kernels tests/tools/test_baseline.py 2>&1 \
  | tee "$OUT/tests.log" | tail -25
python3 -m kvplan bench --staging --no-progress --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.md"
python3 -m benchmarks.publish_latency --json "$OUT/publish_latency.json" 2>&1 | tee "$OUT/publish_latency.md"
KVPLAN_BENCH_SCALE=1 KVPLAN_BENCH_GATES=1 python3 -m pytest -q -p no:cacheprovider benchmarks \
  --benchmark-columns=median,ops --benchmark-sort=name 2>&1 | tail -40 | tee "$OUT/pytest_benchmark.log"
