#!/usr/bin/env bash
# Per-request checksums (kvplan.transport.integrity) on one GPU through NIXL: the kernel's tests
# compiled, its speed against a device copy, then kvplan demo with and without --integrity (staged and
# direct, the llama70b batch), and a short kvplan load with --integrity.
# Usage (the NIXL and pyzmq wheels carried in .whl):  OUT=/some/dir bash benchmarks/gpu_integrity.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" .whl
log="$OUT/integrity.txt"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$log"
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_checksum.py 2>&1 | tail -2 | tee -a "$log"
python3 -m benchmarks.checksum_bandwidth 2>&1 | tee -a "$log"
batch="--preset llama70b-tp8-p64 --layers 8 --requests 8 --prompt-len 8192 --repeat 12"
for mode in "--mode staged --staging-mib 512 --staging-slots 1" "--mode direct"; do
  for flag in "" "--integrity"; do
    echo "\$ kvplan demo $mode $flag $batch" | tee -a "$log"
    timeout 120 python3 -m kvplan demo --no-progress $mode $flag $batch 2>&1 | grep -v "^[IW][0-9]" | tee -a "$log"
  done
done
echo "\$ kvplan load --rate 50 --duration 20 --integrity" | tee -a "$log"
timeout 120 python3 -m kvplan load --rate 50 --duration 20 --integrity --json "$OUT/load-integrity.json" 2>&1 \
  | grep -v "^[IW][0-9]" | tail -10 | tee -a "$log"
