#!/bin/bash
# Session 34's second device call: kvplan load on one H200 after the control-plane changes, with the secret
# set: 1x and 2x of the 400/s capacity session 31 measured, and an overload (3,000/s, rows 256).
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT:/tmp/site KVPLAN_SECRET="session-34-$RANDOM$RANDOM"
R=$OUT/r; mkdir -p $R/j
RUN="python3 -m kvplan load --forward-tokens-per-s 1e12 --fault-every 0 --duration 4 --timeout 5 --no-progress"
SUM="python3 benchmarks/results/2026-12-02-h200-session31-capacity/summary.py"
one() { name=$1; shift; timeout 75 $RUN "$@" --json $R/j/$name.json > $R/$name.log 2>&1; echo "== $name rc $? ($SECONDS s)"; $SUM $R/j/$name.json 2>&1 | head -6; }
{
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
timeout 150 $RUN --rows 64 --rate 20 --duration 1 --timeout 60 > $R/warm.log 2>&1; echo "warm-up rc $? ($SECONDS s)"; tail -n 2 $R/warm.log
one auto-400 --rows 64 --rate 400
one auto-800 --rows 64 --rate 800
one auto-3000-r256 --rows 256 --rate 3000
echo "== end ($SECONDS s)"
} > $R/load.txt 2>&1
tar -czf $OUT/load.tar.gz -C $R j load.txt
tail -c 8000 $R/load.txt
