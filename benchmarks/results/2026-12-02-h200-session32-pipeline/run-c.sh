#!/bin/bash
# Session 32's third device call: issue 53's item 6 table, this tree. The capacity of one prefill process (NIXL
# auto, rows 64, p99 within 500 ms: kvplan load --find-capacity), then each mode and engine at 0.5x, 1x and 2x
# that capacity. Call d runs the tree of before the change (1266f61) at the same rates.
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=${TREE:-$ROOT}:/tmp/site
WHO=${WHO:-now}
R=$OUT/r; mkdir -p $R/j
# run from the tree's own folder: `python3 -m` puts the working directory ahead of PYTHONPATH, so from the
# repository's root the tree of before would silently be this one (as call d's first try found)
RUN="env -C ${TREE:-$ROOT} python3 -m kvplan load --forward-tokens-per-s 1e12 --rows 64 --fault-every 0 --duration 4 --timeout 5 --no-progress"
MC="--engine mooncake --engine-setting protocol=nvlink_intra"
SUM="python3 benchmarks/results/2026-12-02-h200-session31-capacity/summary.py"
{
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; nproc
echo "tree: $WHO: $(cd ${TREE:-$ROOT} && python3 -c 'import kvplan; print(kvplan.__file__)')"
timeout 150 $RUN --rate 20 --duration 1 --timeout 60 > $R/warm.log 2>&1; echo "warm-up rc $? ($SECONDS s)"; tail -n 1 $R/warm.log
timeout 150 $RUN --rate 20 --duration 1 --timeout 60 $MC --mode staged > $R/warm-mc.log 2>&1; echo "warm-up mooncake rc $? ($SECONDS s)"; tail -n 1 $R/warm-mc.log
if [ -z "$CAP" ]; then
  echo "== capacity ($SECONDS s)"
  timeout 240 $RUN --rate 100 --find-capacity 500 --capacity-steps 2 --json $R/j/capacity.json 2>&1 | tail -9
  CAP=$(python3 -c "import json; print(int(json.load(open('$R/j/capacity.json'))['capacity']))")
fi
echo "capacity $CAP ($SECONDS s)"
for x in 0.5 1 2; do
  RATE=$(python3 -c "print(max(1, round($CAP * $x)))")
  for m in auto staged direct mc-staged; do
    args="--mode $m"; [ $m = mc-staged ] && args="--mode staged $MC"
    timeout 60 $RUN --rate $RATE $args --json $R/j/$WHO-$m-${x}x.json > $R/$WHO-$m-${x}x.log 2>&1
    echo "$WHO $m ${x}x ($RATE/s): rc $? ($SECONDS s)"
  done
done
$SUM $R/j/$WHO-*.json
echo "== end ($SECONDS s)"
} > $R/c.txt 2>&1
grep -h -v "^request '" $R/*.log | grep -i "lost\|traceback\|error" | sort | uniq -c | head -20 >> $R/c.txt
tar -czf $OUT/$WHO.tar.gz -C $R j c.txt
tail -c 11000 $R/c.txt
