#!/usr/bin/env bash
# The issue-11 staged batch (llama70b-tp8-p64, 8 layers, 8 x 8192 tokens) through NIXL, the working tree
# against an earlier one, alternating on one machine, every byte verified; then a traced run of the new.
# Put the earlier tree in ./prev first (here: git archive <rev> kvplan | tar -x -C prev; carry it).
# STAGING (MiB:slots ...), ROUNDS, REPEAT, DECODE_GPU=1 (decode on a second card) vary the runs.
# Usage on the GPU machine:  OUT=/some/dir bash benchmarks/gpu_staged_ab.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" .whl
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
ARGS="--no-progress --engine nixl --preset llama70b-tp8-p64 --layers 8 --requests 8 --prompt-len 8192 --mode staged \
  --decode-gpu ${DECODE_GPU:-0}"
here=$PWD
for staging in ${STAGING:-512:1}; do
  for round in $(seq "${ROUNDS:-2}"); do
    for tree in prev new; do
      [ "$tree" = prev ] && [ ! -d prev/kvplan ] && continue
      dir=$([ "$tree" = prev ] && echo "$here/prev" || echo "$here")
      echo "\$ [$tree] kvplan demo $ARGS --staging-mib ${staging%%:*} --staging-slots ${staging##*:} --repeat ${REPEAT:-12}" \
        | tee -a "$OUT/ab.txt"
      (cd "$dir" && PYTHONPATH=.:/tmp/site timeout 240 python3 -m kvplan demo $ARGS --staging-mib "${staging%%:*}" \
        --staging-slots "${staging##*:}" --repeat "${REPEAT:-12}") 2>&1 | grep -E 'steady|spread|transfer|mode|verif|result' \
        | tee -a "$OUT/ab.txt"
    done
  done
  echo "\$ [new] traced, --repeat 8" >> "$OUT/trace.txt"
  KVPLAN_TRACE=1 timeout 240 python3 -m kvplan demo $ARGS --staging-mib "${staging%%:*}" --staging-slots "${staging##*:}" \
    --repeat 8 2>&1 | grep -E 'waves|steady' >> "$OUT/trace.txt"
done
