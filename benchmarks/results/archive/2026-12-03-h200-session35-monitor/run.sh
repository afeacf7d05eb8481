#!/bin/bash
# Session 35's first device call (the control channel's monitor without handshake events): the GPU staged
# demo three times in a row over each engine, the six fault drills over each, with the shared secret set;
# then the adversary tests (strangers while requests move, a restarted peer, a stopped sender) on the GPU.
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT:/tmp/site TRITON_INTERPRET=0 UCX_NET_DEVICES=lo
export KVPLAN_SECRET="session-35-$RANDOM$RANDOM"
R=$OUT/r; mkdir -p $R
{
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; git log -1 --format=%h 2>/dev/null
for engine in nixl mooncake; do
  for n in 1 2 3; do
    echo "== demo $engine staged #$n ($SECONDS s)"
    timeout 200 python3 -m kvplan demo --engine $engine --mode staged > $R/demo-$engine-$n.log 2>&1; echo "rc $?"
    grep -E "every byte|differ|GiB/s" $R/demo-$engine-$n.log | head -3
  done
  for fault in dead-decode dead-prefill dead-decode-mid dead-prefill-mid bad-registration deadline; do
    echo "== drill $engine $fault ($SECONDS s)"
    timeout 100 python3 -m kvplan demo --engine $engine --mode staged --fault $fault > $R/drill-$engine-$fault.log 2>&1; echo "rc $?"
    tail -n 2 $R/drill-$engine-$fault.log
  done
done
echo "== adversary tests on the GPU, five rounds ($SECONDS s)"
for n in 1 2 3 4 5; do
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/transport/test_scanned_while_moving.py tests/transport/test_restart.py \
    tests/transport/test_silent_sender.py tests/transport/test_listener.py 2>&1 | tail -n 2
  echo "round $n rc ${PIPESTATUS[0]} ($SECONDS s)"
done
echo "== end ($SECONDS s)"
} > $R/run.txt 2>&1
tar -czf $OUT/r.tar.gz -C $R .
tail -c 11000 $R/run.txt
