#!/bin/bash
# Session 36's device call (bound control channels are ROUTER sockets, connecting ones DEALER): with the shared
# secret set, the GPU staged demo twice over each engine and the six fault drills over each; the adversary
# tests two rounds as the suite runs them (CPU tensors, the Triton interpreter); then kvplan load at 400/s
# and overloaded (3,000/s, rows 256) on this tree and on session 35's (958b196, PAIR sockets; build/old-tree).
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo
export KVPLAN_SECRET="session-36-$RANDOM$RANDOM"
R=$OUT/r; mkdir -p $R/j
SUM="python3 $ROOT/benchmarks/results/2026-12-02-h200-session31-capacity/summary.py"
RUN="python3 -m kvplan load --forward-tokens-per-s 1e12 --fault-every 0 --duration 4 --timeout 5 --no-progress"
one() { tree=$1; name=$2; shift 2; (cd $tree && PYTHONPATH=$tree:/tmp/site timeout 75 $RUN "$@" --json $R/j/$name.json > $R/$name.log 2>&1); echo "== $name rc $? ($SECONDS s)"; $SUM $R/j/$name.json 2>&1 | head -5; }
{
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
for engine in nixl mooncake; do
  for n in 1 2; do
    echo "== demo $engine staged #$n ($SECONDS s)"
    PYTHONPATH=$ROOT:/tmp/site TRITON_INTERPRET=0 timeout 200 python3 -m kvplan demo --engine $engine --mode staged > $R/demo-$engine-$n.log 2>&1; echo "rc $?"
    grep -E "every byte|differ|GiB/s" $R/demo-$engine-$n.log | head -3
  done
  for fault in dead-decode dead-prefill dead-decode-mid dead-prefill-mid bad-registration deadline; do
    echo "== drill $engine $fault ($SECONDS s)"
    PYTHONPATH=$ROOT:/tmp/site TRITON_INTERPRET=0 timeout 100 python3 -m kvplan demo --engine $engine --mode staged --fault $fault > $R/drill-$engine-$fault.log 2>&1; echo "rc $?"
    tail -n 2 $R/drill-$engine-$fault.log
  done
done
for n in 1 2; do
  PYTHONPATH=$ROOT:/tmp/site TRITON_INTERPRET=1 timeout 100 python3 -m pytest -q -rf -p no:cacheprovider tests/transport/test_scanned_while_moving.py \
    tests/transport/test_restart.py tests/transport/test_silent_sender.py tests/transport/test_listener.py \
    tests/transport/test_control.py tests/transport/test_control_auth.py 2>&1 | tail -n 4
  echo "adversary round $n rc ${PIPESTATUS[0]} ($SECONDS s)"
done
(cd $ROOT && PYTHONPATH=$ROOT:/tmp/site timeout 150 $RUN --rows 64 --rate 20 --duration 1 --timeout 60 > $R/warm.log 2>&1); echo "warm-up rc $? ($SECONDS s)"
one $ROOT new-400 --rows 64 --rate 400
one $ROOT new-3000-r256 --rows 256 --rate 3000
one $ROOT/build/old-tree old-3000-r256 --rows 256 --rate 3000
one $ROOT new-3000-r256-again --rows 256 --rate 3000
echo "== end ($SECONDS s)"
} > $R/run.txt 2>&1
tar -czf $OUT/r.tar.gz -C $R .
tail -c 11000 $R/run.txt
