#!/usr/bin/env bash
# Two GPUs of one host, NIXL wheels carried in .whl: the two-card end-to-end table (issue 11), then the
# exposed transfer time streamed in layer groups against sent after the pass (issue 15), decode on GPU 1.
# Usage on the GPU machine:  OUT=/some/dir bash benchmarks/gpu_final_two_cards.sh
set -uo pipefail
here="$(dirname "$0")"
timeout 230 bash "$here/gpu_two_cards.sh" > /dev/null 2>&1
grep -vE "^[IEW][0-9]{4} " "$OUT/two-cards.txt" | grep -E "^\\$|ceiling|steady|first batch|result|GPU"
OUT=$OUT TESTS=0 DEMOS=0 SKIP_SIGNAL=1 BENCH_S=330 \
  BENCH_ARGS="--decode-gpu 1 --staging 256:2 --staging 512:1 --modes staged --largest-only --repeat 8" \
  bash "$here/gpu_layerwise.sh" 2>&1 | tail -30
