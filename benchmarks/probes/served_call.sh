#!/bin/bash
# One card call for issue 74: the served rows before (.baseline) and after (this tree), interleaved; higher
# rates and a profile of the new code; its capacity with NIXL and ipc. Everything lands in $OUT/served.tgz.
#   bash benchmarks/probes/served_call.sh      (carrying .whl-both and .baseline)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
r=/tmp/r; mkdir -p $r
probe=benchmarks/probes/served_rows.sh
ROWS="tiny-1000-nixl tiny-1000-ipc llama8b-200-nixl" bash $probe $r before=.baseline after=.
ROWS="tiny-3000-nixl tiny-3000-ipc" bash $probe $r after=.
KVPLAN_PROFILE=$r/prof ROWS=tiny-1000-nixl bash $probe $r/prof after=.
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo NIXL_LOG_LEVEL=WARN PYTHONPATH="$PWD:/tmp/site"
for engine in nixl ipc; do
  timeout 110 python3 -m kvplan load --fault-every 0 --forward-tokens-per-s 1e12 --timeout 5 --duration 3 --no-progress \
    --rows 64 --engine $engine --rate 1000 --find-capacity 50 --capacity-steps 1 --json $r/capacity-$engine.json \
    >$r/capacity-$engine.txt 2>&1
  echo "== capacity $engine (rc $?)"; tail -4 $r/capacity-$engine.txt | cut -c1-300
done
tar czf $OUT/served.tgz -C $r .
