#!/bin/bash
# Session 30's third device call: where a batch's time goes at 1000/s offered (the prefill's profile, both
# threads), and each mode and engine now and before at 1000/s and at 100/s (below every bound), one text file.
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R/prof $R/j
NOW="env PYTHONPATH=$ROOT:/tmp/site python3 -m kvplan"
BEFORE="env PYTHONPATH=$ROOT/.before53:/tmp/site python3 -m kvplan"
RUN="load --forward-tokens-per-s 1e12 --rows 64 --fault-every 0 --duration 4 --timeout 5 --no-progress"
MC="--engine mooncake --engine-setting protocol=nvlink_intra"
KVPLAN_PROFILE=$R/prof timeout 90 $NOW $RUN --rate 1000 --json $R/j/now-auto-1000-prof.json > /dev/null 2>&1
for rate in 100 1000; do
  for m in "auto" "direct" "staged" "mc-staged"; do
    args="--mode $m"; [ $m = mc-staged ] && args="--mode staged $MC"
    timeout 90 $NOW $RUN --rate $rate $args --json $R/j/now-$m-$rate.json > /dev/null 2>&1
    timeout 90 $BEFORE $RUN --rate $rate $args --json $R/j/before-$m-$rate.json > /dev/null 2>&1
  done
done
{
python3 benchmarks/results/2026-12-02-h200-session30-nonblocking/summary.py $R/j/*.json
echo "== prefill profile (1000/s, auto)"; cat $R/prof/load-prefill.txt
echo "== decode 0 profile"; sed -n 1,45p $R/prof/load-decode-0.txt
} > $R/c.txt 2>&1
rm -rf $R/prof
python3 benchmarks/results/2026-12-02-h200-session30-nonblocking/summary.py $R/j/*.json
