#!/bin/bash
# Session 30's first device call (one NVIDIA H200): issue 53's item 6. The capacity of one prefill process
# (kvplan load --find-capacity, NIXL auto), then NIXL auto at 0.5x, 1x and 2x that capacity, and the tree of
# before the change (commit 1266f61, the package alone under .before53) at 1x and 2x, the same run.
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
NOW="env PYTHONPATH=$ROOT:/tmp/site python3 -m kvplan"
BEFORE="env PYTHONPATH=$ROOT/.before53:/tmp/site python3 -m kvplan"
# the run: 2 decodes, ~600-token prompts (median 512), 4 layers, a forward pass that costs nothing
RUN="load --forward-tokens-per-s 1e12 --rows 64 --fault-every 0 --duration 4 --timeout 5 --no-progress"
{
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; nproc
echo "== capacity: NIXL auto, p99 within 100 ms"
timeout 300 $NOW $RUN --rate 1000 --find-capacity 100 --capacity-steps 2 --json $R/capacity.json 2>&1 | tail -15
CAP=$(python3 -c "import json; print(int(json.load(open('$R/capacity.json'))['capacity']))")
echo "capacity $CAP"
for x in 0.5 1 2; do
  RATE=$(python3 -c "print(max(1, round($CAP * $x)))")
  timeout 60 $NOW $RUN --rate $RATE --json $R/now-nixl-auto-${x}x.json > $R/now-nixl-auto-${x}x.txt 2>&1
done
for x in 1 2; do
  RATE=$(python3 -c "print(max(1, round($CAP * $x)))")
  timeout 90 $BEFORE $RUN --rate $RATE --json $R/before-nixl-auto-${x}x.json > $R/before-nixl-auto-${x}x.txt 2>&1
done
python3 benchmarks/results/2026-12-02-h200-session30-nonblocking/summary.py $R/now-*.json $R/before-*.json
} 2>&1 | tee $R/a.txt
