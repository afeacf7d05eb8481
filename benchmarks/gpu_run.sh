#!/usr/bin/env bash
# One GPU session: the kernel tests compiled for the card, the sync check, then plan latency.
# Usage on the GPU machine:  OUT=/some/dir bash benchmarks/gpu_run.sh
set -uo pipefail
export PYTHONPATH=. TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kvplan-gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/card.txt"
python3 -m pytest -q -p no:cacheprovider tests/planner tests/compat tests/kernels 2>&1 | tee "$OUT/tests.log" | tail -25
python3 -m benchmarks.plan_latency --json "$OUT/plan_latency.json" 2>&1 | tee "$OUT/plan_latency.md"
python3 -m benchmarks.publish_latency --json "$OUT/publish_latency.json" 2>&1 | tee "$OUT/publish_latency.md"
python3 -m pytest -q -p no:cacheprovider benchmarks --benchmark-columns=median,ops --benchmark-sort=name 2>&1 | tail -30 | tee "$OUT/pytest_benchmark.log"
