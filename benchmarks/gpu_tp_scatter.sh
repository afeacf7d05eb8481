#!/usr/bin/env bash
# Staged TP scatter (TP 4 -> 8) with the receiver planning its own scatter, against the same runs with
# destination tables (--scatter-tables: the form every head-sliced pairing used before), alternating
# on one machine, every byte verified.
# ENGINE=nixl (wheels in .whl) or mooncake (.whl-mc); DECODE_GPU=1 puts the decode on a second card;
# PRESETS, STAGING (MiB:slots ...), FORMS, REPEAT and PROMPT_LEN narrow or widen the runs.
# Usage on the GPU machine:  OUT=/some/dir bash benchmarks/gpu_tp_scatter.sh
set -uo pipefail
ENGINE=${ENGINE:-nixl}
WHEELS=$([ "$ENGINE" = mooncake ] && echo .whl-mc || echo .whl)
source "$(dirname "$0")/gpu_env.sh" "$WHEELS"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
COMMON="--no-progress --engine $ENGINE --src-tp 4 --dst-tp 8 --layers 8 --requests 8 --prompt-len ${PROMPT_LEN:-4096} \
  --mode staged --repeat ${REPEAT:-8} --decode-gpu ${DECODE_GPU:-0}"
for preset in ${PRESETS:-llama70b-tp8-p64 gptoss-swa-p16 qwen3next-mamba-p64}; do
  for staging in ${STAGING:-256:2}; do
    for form in ${FORMS:-planned tables planned tables}; do
      extra=$([ "$form" = tables ] && echo --scatter-tables || true)
      args="--preset $preset --staging-mib ${staging%%:*} --staging-slots ${staging##*:} $extra"
      echo "\$ kvplan demo $COMMON $args" | tee -a "$OUT/demo.txt"
      timeout 240 python3 -m kvplan demo $COMMON $args 2>&1 | tee -a "$OUT/demo.txt"
      echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/demo.txt"
    done
  done
done
# (tests/transport/test_receiver_plan.py and test_waves.py are CI tests: their pools are host memory, and
# the device machine's Triton 3.6 interpreter fails the copy kernels' loops with its NumPy, triton #9171)
