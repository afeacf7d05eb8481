#!/bin/bash
# Session 32's second device call: where a staged batch's time goes (KVPLAN_TRACE on both sides: every step of
# every run and wave on one clock), NIXL auto at rows 64, 300/s and 1,000/s.
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT:/tmp/site
R=$OUT/r; mkdir -p $R/j
D=benchmarks/results/2026-12-02-h200-session32-pipeline
RUN="python3 -m kvplan load --forward-tokens-per-s 1e12 --fault-every 0 --timeout 5 --no-progress"
SUM="python3 benchmarks/results/2026-12-02-h200-session31-capacity/summary.py"
{
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; nproc
timeout 150 $RUN --rows 64 --rate 20 --duration 1 --timeout 60 > $R/warm.log 2>&1; echo "warm-up rc $? ($SECONDS s)"; tail -n 1 $R/warm.log
for rate in 300 1000; do
  echo "== traced: auto, rows 64, $rate/s ($SECONDS s)"
  KVPLAN_TRACE=1 timeout 90 $RUN --rows 64 --rate $rate --duration 2 --json $R/j/trace-$rate.json > $R/trace-$rate.log 2>&1
  echo "rc $? ($SECONDS s)"; $SUM $R/j/trace-$rate.json | head -3
  python3 $D/trace.py $R/trace-$rate.log
done
echo "== end ($SECONDS s)"
} > $R/b.txt 2>&1
gzip -k $R/trace-*.log
tar -czf $OUT/b.tar.gz -C $R j b.txt
cp $R/trace-*.log.gz $OUT/
tail -c 11000 $R/b.txt
