#!/bin/bash
# Session 31's first device call: where a request's time goes (the load tool's phases), and what the load
# tool's pipeline settings change: one chunk a turn (session 30) against every ready chunk of a request as one
# span, 1, 2 and 4 batches in flight, 64 against 256 rows a decode. NIXL auto, after one warm-up run.
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT:/tmp/site
R=$OUT/r; mkdir -p $R/j
RUN="python3 -m kvplan load --forward-tokens-per-s 1e12 --fault-every 0 --duration 4 --timeout 5 --no-progress"
SUM="python3 benchmarks/results/2026-12-02-h200-session31-capacity/summary.py"
one() { name=$1; shift; timeout 75 $RUN "$@" --json $R/j/$name.json > $R/$name.log 2>&1; echo "rc $? ($SECONDS s)"; $SUM $R/j/$name.json 2>&1 | head -5; }
{
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; nproc
timeout 120 $RUN --rows 64 --rate 20 --duration 1 > $R/warm.log 2>&1; echo "warm-up rc $? ($SECONDS s)"
one turn-100 --rows 64 --rate 100 --chunk-per-turn
one merged-100 --rows 64 --rate 100
one turn-1000 --rows 64 --rate 1000 --chunk-per-turn
one merged-1000 --rows 64 --rate 1000
one merged-1000-f1 --rows 64 --rate 1000 --in-flight 1
one merged-1000-f4 --rows 64 --rate 1000 --in-flight 4
one merged-1000-r256 --rows 256 --rate 1000
one merged-3000-r256 --rows 256 --rate 3000
KVPLAN_PROFILE=$R/prof one merged-1000-prof --rows 64 --rate 1000
echo "== prefill profile"; head -60 $R/prof/load-prefill.txt | cut -c1-200
echo "== end ($SECONDS s)"
} > $R/a.txt 2>&1
tail -n 30 $R/merged-100.log > $R/merged-100.tail 2>/dev/null
tar -czf $OUT/a.tar.gz -C $R j a.txt
cat $R/a.txt
