#!/bin/bash
# Session 34's device call (issue 54's "done when"): the GPU staged demo and the fault drills over NIXL and
# Mooncake with the control plane's shared secret set, then the two-process hand-off tests on the GPU with it.
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT:/tmp/site TRITON_INTERPRET=0 UCX_NET_DEVICES=lo
export KVPLAN_SECRET="session-34-$RANDOM$RANDOM"
R=$OUT/r; mkdir -p $R
{
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; nproc
for engine in nixl mooncake; do
  for mode in staged direct; do
    echo "== demo $engine $mode ($SECONDS s)"
    timeout 240 python3 -m kvplan demo --engine $engine --mode $mode > $R/demo-$engine-$mode.log 2>&1; echo "rc $?"
    grep -E "every byte|differ|mode|GiB/s|secret" $R/demo-$engine-$mode.log | head -6
  done
  for fault in dead-decode dead-prefill dead-decode-mid dead-prefill-mid bad-registration deadline; do
    echo "== drill $engine $fault ($SECONDS s)"
    timeout 120 python3 -m kvplan demo --engine $engine --mode staged --fault $fault > $R/drill-$engine-$fault.log 2>&1; echo "rc $?"
    tail -n 2 $R/drill-$engine-$fault.log
  done
done
echo "== pytest on the GPU with the secret ($SECONDS s)"
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/transport/test_handoff_secret.py tests/transport/test_silent_sender.py \
  tests/transport/test_handoff.py -k "staged or secret or silent or sender or dead or deadline" 2>&1 | tail -n 15
echo "== end ($SECONDS s)"
} > $R/run.txt 2>&1
tar -czf $OUT/r.tar.gz -C $R .
tail -c 11000 $R/run.txt
