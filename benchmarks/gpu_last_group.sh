#!/usr/bin/env bash
# Where a streamed last layer group's time goes, on two GPUs of one host (issue 15): NIXL's cost of
# one write with its notification by size (benchmarks/post_cost.py, across the cards and within one),
# traced demos of llama70b-tp8-p64 streamed in 8 even or tapered groups, then benchmarks/layerwise.py
# with both splits. Carry .whl. STAGINGS (default "256:2 512:1"), REPEAT (default 6), TRACES=0 skips
# the traced demos (TRACE_STAGINGS, TRACE_SPLITS, TRACE_PRESETS (llama70b gptoss) and TRACE_UPLOADS
# (KVPLAN_UPLOAD_GRAPHS values) choose them: default every staging, both splits, llama70b, 1),
# POST=0 the engine's post cost (POST_SIZES: MiB), GRAPHS=0 the scatter-launch microbenchmark
# (benchmarks/graph_launch.py), BENCH=0 the benchmark (SPLITS: default "even tapered").
# Usage on the GPU machine:  OUT=/some/dir bash benchmarks/gpu_last_group.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" .whl
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
nvidia-smi topo -m | head -4 >> "$OUT/card.txt"
STAGINGS=${STAGINGS:-"256:2 512:1"}
if [ "${POST:-1}" = 1 ]; then
  timeout 120 python3 -m benchmarks.post_cost 1 ${POST_SIZES:-} 2>&1 | tee "$OUT/post-cost.txt"
  [ "${POST_ONE_CARD:-1}" = 1 ] && timeout 120 python3 -m benchmarks.post_cost 0 ${POST_SIZES:-} 2>&1 | tee -a "$OUT/post-cost.txt"
fi
[ "${GRAPHS:-1}" = 1 ] && timeout 120 python3 -m benchmarks.graph_launch 2>&1 | tee "$OUT/graph-launch.txt"
if [ "${TRACES:-1}" = 1 ]; then
  for preset in ${TRACE_PRESETS:-llama70b}; do
  case $preset in
    llama70b) model="--preset llama70b-tp8-p64 --layers 80 --forward-dim 10240 --layerwise 8";;
    gptoss) model="--preset gptoss-swa-p16 --layers 18 --forward-dim 16896 --layerwise 6";;
  esac
  for staging in ${TRACE_STAGINGS:-$STAGINGS}; do for split in ${TRACE_SPLITS:-even tapered}; do
  for upload in ${TRACE_UPLOADS:-1}; do
    args="$model --layer-split $split --mode staged
          --decode-gpu 1 --staging-mib ${staging%:*} --staging-slots ${staging#*:} --requests 1 --prompt-len 8192 --chunks 1
          --repeat 4 --timeout 30"
    echo "\$ KVPLAN_UPLOAD_GRAPHS=$upload KVPLAN_TRACE=1 kvplan demo $args" | tr -s ' \n' ' ' | tee -a "$OUT/trace.txt"
    echo >> "$OUT/trace.txt"
    KVPLAN_UPLOAD_GRAPHS=$upload KVPLAN_TRACE=1 timeout 100 python3 -m kvplan demo --no-progress --engine nixl $args \
      >> "$OUT/trace.txt" 2>&1
    echo "exit $?" >> "$OUT/trace.txt"
  done; done; done; done
  grep -E "exposed|streamed in|result|exit" "$OUT/trace.txt"
fi
if [ "${BENCH:-1}" = 1 ]; then
  stagings=$(for s in $STAGINGS; do printf -- "--staging %s " "$s"; done)
  timeout "${BENCH_S:-400}" python3 benchmarks/layerwise.py --out "$OUT" --engine nixl --skip-signal --decode-gpu 1 \
    $stagings --modes staged --largest-only --repeat "${REPEAT:-6}" $(for s in ${SPLITS:-even tapered}; do printf -- "--split %s " "$s"; done) \
    2>&1 | tee "$OUT/layerwise.log" | grep -v "^\s*$" | tail -30
fi
