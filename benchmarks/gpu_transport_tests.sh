#!/usr/bin/env bash
# The transport's tests on one GPU, compiled kernels, NIXL and pyzmq carried in .whl: the copy kernels
# and their graphs, the device planner's outputs the staged path reads, the sync test, and the NIXL
# hand-offs in staged mode (twenty batches in a row among them).
# Usage on the GPU machine:  OUT=/some/dir bash benchmarks/gpu_transport_tests.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" .whl
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
timeout 420 python3 -m pytest -q -p no:cacheprovider -rfE tests/transport/test_copy_graphs.py tests/transport/test_local.py \
  tests/planner/test_device_planner.py tests/planner/test_gpu_sync.py \
  "tests/transport/test_handoff.py" -k "not mooncake and (staged or Copy or copy or local or device or sync or ahead)" \
  2>&1 | tee "$OUT/tests.txt" | tail -15
