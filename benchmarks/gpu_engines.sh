#!/usr/bin/env bash
# The two-process hand-off tests with VRAM pools on a GPU, through one engine whose cp312 wheel
# was carried in .whl (NIXL: nixl_cu13) or .whl-mc (Mooncake: mooncake-transfer-engine-cuda13).
# Usage on the GPU machine:  OUT=/some/dir bash benchmarks/gpu_engines.sh nixl|mooncake
set -uo pipefail
engine=$1
wheels=.whl; [ "$engine" = mooncake ] && wheels=.whl-mc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl || exit 1
export PYTHONPATH=.:/tmp/site TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo NIXL_LOG_LEVEL=WARN
python3 -c 'import zmq' || { echo "pyzmq is missing: carry its wheel with the engine's"; exit 1; }
export KVPLAN_TEST_ENGINES=$engine
OUT=${OUT:-/tmp/kvplan-gpu}; mkdir -p "$OUT"
python3 -m pytest -q -p no:cacheprovider tests/transport 2>&1 | tee "$OUT/engines-$engine.log" | tail -30
