#!/bin/bash
# Session 31's second device call: the control channel's receive queue unbounded (a busy receiver's heartbeats
# still answered) and both sides warmed up before the run; then the 1,000/s runs that failed in call a again,
# and the capacity of one prefill process (NIXL auto, rows 64, p99 within 500 ms).
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT:/tmp/site
R=$OUT/r; mkdir -p $R/j
RUN="python3 -m kvplan load --forward-tokens-per-s 1e12 --fault-every 0 --duration 4 --timeout 5 --no-progress"
SUM="python3 benchmarks/results/2026-12-02-h200-session31-capacity/summary.py"
one() { name=$1; shift; timeout 75 $RUN "$@" --json $R/j/$name.json > $R/$name.log 2>&1; echo "rc $? ($SECONDS s)"; $SUM $R/j/$name.json 2>&1 | head -5; }
{
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; nproc
timeout 150 $RUN --rows 64 --rate 20 --duration 1 --timeout 60 > $R/warm.log 2>&1; echo "warm-up rc $? ($SECONDS s)"; tail -n 9 $R/warm.log
one merged-100 --rows 64 --rate 100
one merged-1000 --rows 64 --rate 1000
one merged-1000-r256 --rows 256 --rate 1000
one merged-3000-r256 --rows 256 --rate 3000
echo "== capacity: NIXL auto, rows 64, p99 within 500 ms ($SECONDS s)"
timeout 300 $RUN --rows 64 --rate 100 --find-capacity 500 --capacity-steps 2 --json $R/j/capacity.json 2>&1 | tail -9
echo "== end ($SECONDS s)"
} > $R/b.txt 2>&1
grep -h -v "^request '" $R/*.log | grep -i "lost\|traceback\|error" | sort | uniq -c | head -20 >> $R/b.txt
tar -czf $OUT/b.tar.gz -C $R j b.txt
cat $R/b.txt
