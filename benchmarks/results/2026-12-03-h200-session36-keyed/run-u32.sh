#!/bin/bash
# Session 36's third device call: the checksum kernel's hash in 32-bit lanes (keyed and unkeyed), its tests
# compiled on the GPU and its speed, against the same benchmark of the int64-lane kernel (run.txt).
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd) TRITON_INTERPRET=0
{
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_checksum.py 2>&1 | tail -n 2
for n in 1 2; do echo "== bandwidth #$n ($SECONDS s)"; timeout 120 python3 -m benchmarks.checksum_bandwidth 2>&1 | tail -n 7; done
} > $OUT/run-u32.txt 2>&1
cat $OUT/run-u32.txt
