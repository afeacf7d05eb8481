#!/bin/bash
# Session 30's fourth device call: issue 53's item 6 table from one run. The capacity of one prefill process
# (NIXL auto; p99 within 1,500 ms: at 100/s, far below every bound, p99 was 0.9-1.3 s, call c), then every mode
# and engine at 0.5x, 1x and 2x that capacity, now, and before the change (commit 1266f61) for NIXL auto at 1x (call c has before for every mode).
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R/j
NOW="env PYTHONPATH=$ROOT:/tmp/site python3 -m kvplan"
BEFORE="env PYTHONPATH=$ROOT/.before53:/tmp/site python3 -m kvplan"
RUN="load --forward-tokens-per-s 1e12 --rows 64 --fault-every 0 --duration 4 --timeout 5 --no-progress"
MC="--engine mooncake --engine-setting protocol=nvlink_intra"
{
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; nproc
timeout 60 $NOW $RUN --rate 50 > /dev/null 2>&1  # (kernels compiled once on this machine before the search)
echo "== capacity: NIXL auto, p99 within 1500 ms"
timeout 240 $NOW $RUN --rate 100 --find-capacity 1500 --capacity-steps 1 --json $R/j/capacity.json 2>&1 | tail -8
CAP=$(python3 -c "import json; print(int(json.load(open('$R/j/capacity.json'))['capacity']))" 2>/dev/null || echo 200)
echo "capacity $CAP"
for m in auto direct staged mc-staged; do
  args="--mode $m"; [ $m = mc-staged ] && args="--mode staged $MC"
  for x in 0.5 1 2; do
    RATE=$(python3 -c "print(max(1, round($CAP * $x)))")
    timeout 60 $NOW $RUN --rate $RATE $args --json $R/j/now-$m-${x}x.json > /dev/null 2>&1
    [ $x = 1 ] && [ $m = auto ] && timeout 60 $BEFORE $RUN --rate $RATE $args --json $R/j/before-$m-${x}x.json > /dev/null 2>&1
  done
done
python3 benchmarks/results/2026-12-02-h200-session30-nonblocking/summary.py $R/j/now-*.json $R/j/before-*.json
} > $R/d.txt 2>&1
tar -czf $OUT/d-json.tar.gz -C $R j
cat $R/d.txt
