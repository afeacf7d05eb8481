#!/usr/bin/env bash
# Issue 37's warm start on one GPU (NIXL carried in .whl): the GPU tests the warm-up touches, then the
# first batch against the steady ones with and without the endpoints' warm_up(), then the demo's
# fault drills (staged and direct) once each on the new transport.
# Usage on the GPU machine:  OUT=/some/dir bash benchmarks/gpu_warm_start.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" .whl
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE ${TESTS:-tests/planner/test_graphs.py tests/planner/test_device_planner.py \
  tests/transport/test_copy_graphs.py tests/transport/test_local.py tests/kernels} \
  2>&1 | tee "$OUT/tests.txt" | tail -5
log="$OUT/warm-start.txt"
common="--no-progress --engine nixl --layers 8 --requests 8 --prompt-len 8192 --repeat 8"
# a first start on an empty kernel cache, with the warm-up: what it costs when it compiles everything
export TRITON_CACHE_DIR=$(mktemp -d)
echo "\$ (empty kernel cache) kvplan demo $common --preset llama70b-tp8-p64 --mode auto --staging-mib 256 --staging-slots 2" | tee -a "$log"
timeout 240 python3 -m kvplan demo $common --preset llama70b-tp8-p64 --mode auto --staging-mib 256 --staging-slots 2 \
  2>&1 | grep -E "kvplan demo|warm-up|transfer|steady|spread|verified|FAIL|Error" | tee -a "$log"
for preset in llama70b-tp8-p64 llama70b-tp4to8-p64; do  # the kernel cache filled for both presets: the rows below compare alike
  python3 -m kvplan demo $common --preset $preset --mode auto --staging-mib 256 --staging-slots 2 > /dev/null 2>&1
  python3 -m kvplan demo $common --preset $preset --mode auto --staging-mib 256 --staging-slots 2 --no-warm-up > /dev/null 2>&1
done
for preset in llama70b-tp8-p64 llama70b-tp4to8-p64; do
  for mode in ${MODES:-staged auto direct}; do
    [ "$preset" = llama70b-tp4to8-p64 ] && [ "$mode" = direct ] && continue  # (1M descriptors direct: minutes)
    for warm in "" --no-warm-up; do
      echo "\$ kvplan demo $common --preset $preset --mode $mode --staging-mib 256 --staging-slots 2 $warm" | tee -a "$log"
      timeout 240 python3 -m kvplan demo $common --preset $preset --mode $mode --staging-mib 256 --staging-slots 2 $warm \
        2>&1 | grep -E "kvplan demo|warm-up|transfer|steady|spread|verified|FAIL|Error" | tee -a "$log"
    done
  done
done
drills="$OUT/drills.txt"
for mode in ${DRILL_MODES:-staged direct}; do
  for fault in dead-decode dead-prefill dead-decode-mid dead-prefill-mid bad-registration deadline; do
    echo "\$ kvplan demo --fault $fault --mode $mode" | tee -a "$drills"
    timeout 120 python3 -m kvplan demo --no-progress --engine nixl --preset llama70b-tp8-p64 --layers 4 --requests 4 \
      --prompt-len 4096 --mode $mode --fault $fault 2>&1 | tail -3 | tee -a "$drills"
    echo "rc=${PIPESTATUS[0]}" | tee -a "$drills"
  done
done
