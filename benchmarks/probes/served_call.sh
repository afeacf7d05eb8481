#!/bin/bash
# A card call: the served rows before (.baseline) and after (this tree), interleaved; then the
# new code's batches traced (KVPLAN_TRACE) and with more batches in flight. Everything lands in $OUT/served.tgz.
#   bash benchmarks/probes/served_call.sh      (carrying .whl-both and .baseline)
# The first call of 2026-12-07 (results/2026-12-07-h100-served/) ran instead: ROWS "tiny-1000-nixl tiny-1000-ipc
# llama8b-200-nixl" before and after, "tiny-3000-nixl tiny-3000-ipc" after, a profile (KVPLAN_PROFILE) of
# tiny-1000-nixl after, and `--find-capacity 50 --rate 1000 --capacity-steps 1` with NIXL and ipc.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
r=/tmp/r; mkdir -p $r
probe=benchmarks/probes/served_rows.sh
ROWS="tiny-1000-nixl tiny-1000-ipc" bash $probe $r before=.baseline after=.
KVPLAN_TRACE=1 ROWS="tiny-1000-ipc tiny-1000-nixl" bash $probe $r/trace after=.
ROWS="tiny-1000-nixl-if4 tiny-3000-nixl" bash $probe $r after=.
tar czf $OUT/served.tgz -C $r .
