#!/usr/bin/env bash
# The two-process hand-off tests with VRAM pools on a GPU, through one engine whose cp312 wheel
# was carried in .whl (NIXL: nixl_cu13) or .whl-mc (Mooncake: mooncake-transfer-engine-cuda13).
# Usage on the GPU machine:  OUT=/some/dir bash benchmarks/gpu_engines.sh nixl|mooncake
set -uo pipefail
engine=$1
wheels=.whl; [ "$engine" = mooncake ] && wheels=.whl-mc
source "$(dirname "$0")/gpu_env.sh" "$wheels"
python3 -c 'import zmq' || { echo "pyzmq is missing: carry its wheel with the engine's"; exit 1; }
export KVPLAN_TEST_ENGINES=$engine
python3 -m pytest -q -p no:cacheprovider tests/transport 2>&1 | tee "$OUT/engines-$engine.log" | tail -30
