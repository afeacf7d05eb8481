#!/bin/bash
# Session 32's first device call: refusals in one message per decode turn; then where a batch's time goes on
# the prefill's and the decodes' progress threads (KVPLAN_PROFILE: cProfile of each thread), NIXL auto and direct.
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT:/tmp/site
R=$OUT/r; mkdir -p $R/j $R/prof
RUN="python3 -m kvplan load --forward-tokens-per-s 1e12 --fault-every 0 --duration 4 --timeout 5 --no-progress"
SUM="python3 benchmarks/results/2026-12-02-h200-session31-capacity/summary.py"
one() { name=$1; shift; timeout 75 $RUN "$@" --json $R/j/$name.json > $R/$name.log 2>&1; echo "rc $? ($SECONDS s)"; $SUM $R/j/$name.json 2>&1 | head -5; }
{
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; nproc
if [ -z "$ONLY_PROFILE" ]; then
timeout 150 $RUN --rows 64 --rate 20 --duration 1 --timeout 60 > $R/warm.log 2>&1; echo "warm-up rc $? ($SECONDS s)"; tail -n 3 $R/warm.log
one auto-1000 --rows 64 --rate 1000
one auto-3000-r256 --rows 256 --rate 3000
one direct-1000 --rows 64 --rate 1000 --mode direct
fi
for m in auto direct; do
  echo "== profiled: $m, rows 64, 1,000/s ($SECONDS s)"
  KVPLAN_PROFILE=$R/prof/$m KVPLAN_PROFILE_ONLY=${PROFILE_ONLY:-prefill-progress} one prof-$m --rows 64 --rate 1000 --mode $m
  for f in $R/prof/$m/*progress*.txt; do echo "-- $(basename $f)"; awk '/Ordered by: cumulative/{c=1} c' $f | sed -n 1,45p | cut -c1-160; done
done
echo "== end ($SECONDS s)"
} > $R/a.txt 2>&1
grep -h -v "^request '" $R/*.log | grep -i "lost\|traceback\|error" | sort | uniq -c | head -20 >> $R/a.txt
tar -czf $OUT/a.tar.gz -C $R j prof a.txt
tail -c 11000 $R/a.txt
