#!/usr/bin/env bash
# Streaming in layer groups on one GPU (issue 15): the layer-group and transport tests compiled for
# the card, then benchmarks/layerwise.py (what the readiness signal costs the forward pass; time to
# decode-ready with and without streaming) through the engine whose wheels are carried
# (ENGINE=nixl: .whl; ENGINE=mooncake: .whl-mc). TESTS=0 skips the tests; BENCH_ARGS are passed to
# layerwise.py (e.g. "--decode-gpu 0 --decode-gpu 1 --modes staged --repeat 8" on two cards); DEMOS=0
# skips the traced demos.
# Usage on the GPU machine:  OUT=/some/dir ENGINE=nixl bash benchmarks/gpu_layerwise.sh
set -uo pipefail
ENGINE=${ENGINE:-nixl}
WHEELS=$([ "$ENGINE" = mooncake ] && echo .whl-mc || echo .whl)
source "$(dirname "$0")/gpu_env.sh" "$WHEELS"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/card.txt"
if [ "${TESTS:-1}" = 1 ]; then
  KVPLAN_TEST_ENGINES=$ENGINE timeout 300 python3 -m pytest -q -p no:cacheprovider tests/planner/test_layer_groups.py \
    tests/transport/test_handoff.py -k "${TEST_K:-layer}" 2>&1 | tee "$OUT/tests.log" | tail -8
  # the sender's tests use CPU pools (interpreter); its CUDA-event test runs on the card
  timeout 60 python3 -m pytest -q -p no:cacheprovider \
    tests/transport/test_layerwise.py::test_a_groups_event_is_offered_only_once_this_pass_has_queued_its_mark \
    2>&1 | tee -a "$OUT/tests.log" | tail -3
fi
timeout "${BENCH_S:-420}" python3 benchmarks/layerwise.py --out "$OUT" --engine "$ENGINE" ${SKIP_SIGNAL:+--skip-signal} \
  ${BENCH_ARGS:-} \
  2>&1 | tee "$OUT/layerwise.log" | grep -v "^\s*$" | tail -40
[ "${DEMOS:-1}" = 1 ] && for args in "--preset llama70b-tp8-p64 --layers 80 --forward-dim 10240 --layerwise 8 --mode staged" \
            "--preset gptoss-swa-p16 --layers 18 --mode staged" "--preset gptoss-swa-p16 --layers 18 --mode staged --scatter-tables"; do
  echo "\$ KVPLAN_TRACE=1 kvplan demo --engine $ENGINE --requests 1 --prompt-len 8192 --chunks 1 --timeout 30 $args" | tee -a "$OUT/demo.txt"
  KVPLAN_TRACE=1 timeout 100 python3 -m kvplan demo --no-progress --engine "$ENGINE" --requests 1 --prompt-len 8192 --chunks 1 \
    --timeout 30 $args > "$OUT/demo-cur.txt" 2>&1
  echo "exit $?" >> "$OUT/demo-cur.txt"; cat "$OUT/demo-cur.txt" >> "$OUT/demo.txt"; grep -v "waves (wave\|groups (group" "$OUT/demo-cur.txt"
done
