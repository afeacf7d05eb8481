#!/bin/bash
# Session 36's second device call (the keyed integrity checksum): the checksum kernel's tests compiled on the
# GPU (keyed and unkeyed against the NumPy reference, golden values) and their sm90 compile checks; the
# kernel's speed unkeyed and keyed against a device copy; the GPU demo with integrity=True over NIXL (staged
# and direct) and Mooncake (staged), each with and without the shared secret (keyed and unkeyed sums).
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo PYTHONPATH=$ROOT:/tmp/site TRITON_INTERPRET=0
R=$OUT/r; mkdir -p $R
{
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
echo "== kernel tests ($SECONDS s)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_checksum.py 2>&1 | tail -n 3
timeout 200 python3 -m pytest -q -p no:cacheprovider -m compile_check tests/kernels/test_compile.py -k checksum 2>&1 | tail -n 2
echo "== bandwidth ($SECONDS s)"
timeout 120 python3 -m benchmarks.checksum_bandwidth 2>&1 | tail -n 8
for secret in "" "session-36-$RANDOM$RANDOM"; do
  for run in "nixl staged" "nixl direct" "mooncake staged"; do
    set -- $run
    echo "== demo --integrity $1 $2 secret=${secret:+yes} ($SECONDS s)"
    if [ -z "$secret" ]; then E="env -u KVPLAN_SECRET"; else E="env KVPLAN_SECRET=$secret"; fi
    $E timeout 200 python3 -m kvplan demo --engine $1 --mode $2 --integrity > $R/demo-$1-$2-${secret:+keyed}.log 2>&1; echo "rc $?"
    grep -E "every byte|differ|GiB/s|integrity|FAILED" $R/demo-$1-$2-${secret:+keyed}.log | head -4
  done
done
echo "== end ($SECONDS s)"
} > $R/run.txt 2>&1
tar -czf $OUT/r.tar.gz -C $R .
tail -c 11000 $R/run.txt
