#!/bin/bash
# Session 35's second device call: the adversary tests five rounds as the suite runs them (CPU tensors, the
# Triton interpreter: with TRITON_INTERPRET=0 the first call's rounds failed on CPU tensors handed to kernels),
# then kvplan load overloaded (3,000/s, rows 256) on this tree with and without the secret and on the tree
# of session 32's run (e62c3fe, build/old-tree, run from its own folder), and this tree at 400/s.
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R/j
SUM="python3 $ROOT/benchmarks/results/2026-12-02-h200-session31-capacity/summary.py"
RUN="python3 -m kvplan load --forward-tokens-per-s 1e12 --fault-every 0 --duration 4 --timeout 5 --no-progress"
one() { tree=$1; name=$2; shift 2; (cd $tree && PYTHONPATH=$tree:/tmp/site timeout 75 $RUN "$@" --json $R/j/$name.json > $R/$name.log 2>&1); echo "== $name rc $? ($SECONDS s)"; $SUM $R/j/$name.json 2>&1 | head -5; }
{
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
for n in 1 2 3 4 5; do
  PYTHONPATH=$ROOT:/tmp/site TRITON_INTERPRET=1 timeout 100 python3 -m pytest -q -rf -p no:cacheprovider tests/transport/test_scanned_while_moving.py \
    tests/transport/test_restart.py tests/transport/test_silent_sender.py tests/transport/test_listener.py 2>&1 | tail -n 4
  echo "adversary round $n rc ${PIPESTATUS[0]} ($SECONDS s)"
done
(cd $ROOT && PYTHONPATH=$ROOT:/tmp/site timeout 150 $RUN --rows 64 --rate 20 --duration 1 --timeout 60 > $R/warm.log 2>&1); echo "warm-up rc $? ($SECONDS s)"
one $ROOT new-3000-r256 --rows 256 --rate 3000
KVPLAN_SECRET="s35-$RANDOM$RANDOM" one $ROOT new-secret-3000-r256 --rows 256 --rate 3000
one $ROOT/build/old-tree old-3000-r256 --rows 256 --rate 3000
KVPLAN_SECRET="s35-$RANDOM$RANDOM" one $ROOT new-secret-400 --rows 64 --rate 400
echo "== end ($SECONDS s)"
} > $R/load.txt 2>&1
tar -czf $OUT/load.tar.gz -C $R j load.txt
tail -c 9000 $R/load.txt
