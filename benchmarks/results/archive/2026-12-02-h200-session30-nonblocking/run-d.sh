#!/bin/bash
# Session 30's fourth device call: issue 53's item 6 table from one run. The capacity of one prefill process
# (NIXL auto; p99 within 1,500 ms: at 100/s, far below every bound, p99 was 0.9-1.3 s, call c), then every mode
# and engine at 0.5x, 1x and 2x that capacity, now, and before the change (commit 1266f61) for NIXL auto at 1x
# (call c has before for every mode); then the staged demo three times and the staged fault drills.
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R/j
NOW="env PYTHONPATH=$ROOT:/tmp/site python3 -m kvplan"
BEFORE="env PYTHONPATH=$ROOT/.before53:/tmp/site python3 -m kvplan"
RUN="load --forward-tokens-per-s 1e12 --rows 64 --fault-every 0 --duration 4 --timeout 5 --no-progress"
MC="--engine mooncake --engine-setting protocol=nvlink_intra"
SUM="python3 benchmarks/results/2026-12-02-h200-session30-nonblocking/summary.py"
{
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; nproc
timeout 60 $NOW $RUN --rate 50 > /dev/null 2>&1  # (kernels compiled once on this machine before the search)
echo "== capacity: NIXL auto, p99 within 1500 ms ($SECONDS s)"
timeout 240 $NOW $RUN --rate 100 --find-capacity 1500 --capacity-steps 1 --json $R/j/capacity.json 2>&1 | tail -8
CAP=$(python3 -c "import json; print(int(json.load(open('$R/j/capacity.json'))['capacity']))" 2>/dev/null || echo 200)
echo "capacity $CAP ($SECONDS s)"
for m in auto direct staged mc-staged; do
  args="--mode $m"; [ $m = mc-staged ] && args="--mode staged $MC"
  for x in 0.5 1 2; do
    RATE=$(python3 -c "print(max(1, round($CAP * $x)))")
    timeout 60 $NOW $RUN --rate $RATE $args --json $R/j/now-$m-${x}x.json > /dev/null 2>&1; $SUM $R/j/now-$m-${x}x.json
    if [ $x = 1 ] && [ $m = auto ]; then
      timeout 60 $BEFORE $RUN --rate $RATE $args --json $R/j/before-$m-${x}x.json > /dev/null 2>&1; $SUM $R/j/before-$m-${x}x.json
    fi
  done
done
echo "== drills ($SECONDS s)"
export PYTHONPATH=$ROOT:/tmp/site
B="--no-progress --engine nixl --preset llama70b-tp8-p64 --layers 4 --requests 4 --prompt-len 4096"
for i in 1 2 3; do echo "== staged $i ($SECONDS s)"; timeout 30 python3 -m kvplan demo $B --mode staged --repeat 8 2>&1 | grep -E "completed|verification|result"; done
for f in dead-decode dead-prefill dead-decode-mid dead-prefill-mid bad-registration deadline; do
  echo "== drill staged $f ($SECONDS s)"; timeout 25 python3 -m kvplan demo $B --mode staged --fault $f 2>&1 | grep -E "fault|observed|expected" | tail -2
done
echo "== end ($SECONDS s)"
} > $R/d.txt 2>&1
tar -czf $OUT/d-json.tar.gz -C $R j
cat $R/d.txt
