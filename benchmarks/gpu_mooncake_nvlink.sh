#!/usr/bin/env bash
# Mooncake's NVLink transport (protocol nvlink_intra) with the physical ceiling in the same run: a
# torch copy between the cards (on one GPU: within it), Mooncake's own one-write and 64-descriptor
# ceilings, then kvplan demo staged, auto and direct on the llama70b batch (6,832 descriptors), and
# a short kvplan load. Between GPU 0 and GPU 1 where the machine has two, else within GPU 0.
# Usage (the Mooncake CUDA 13 and pyzmq wheels carried in .whl-mc):  OUT=/some/dir bash benchmarks/gpu_mooncake_nvlink.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" .whl-mc
log="$OUT/mooncake-nvlink.txt"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$log"
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
to=$([ "$gpus" -gt 1 ] && echo 1 || echo 0)
python3 -m benchmarks.peer_copy 256 2>&1 | tee -a "$log"
for pieces in 1 64 6832; do
  timeout 120 python3 -m benchmarks.engine_ceiling mooncake 256 $to $pieces protocol=nvlink_intra 2>&1 \
    | grep -v "^[IW][0-9]" | tee -a "$log"
done
batch="--preset llama70b-tp8-p64 --layers 8 --requests 8 --prompt-len 8192 --repeat 12"
for args in "--mode staged --staging-mib 512 --staging-slots 1" "--mode staged --staging-mib 256 --staging-slots 4" \
            "--mode auto --staging-mib 512 --staging-slots 2" "--mode direct"; do
  echo "\$ kvplan demo --engine mooncake --engine-setting protocol=nvlink_intra --decode-gpu $to $args $batch" | tee -a "$log"
  timeout 200 python3 -m kvplan demo --no-progress --engine mooncake --engine-setting protocol=nvlink_intra \
    --decode-gpu $to $args $batch 2>&1 | grep -v "^[IW][0-9]" | tee -a "$log"
done
echo "\$ kvplan load --engine mooncake --engine-setting protocol=nvlink_intra --rate 200 --duration 10" | tee -a "$log"
timeout 150 python3 -m kvplan load --engine mooncake --engine-setting protocol=nvlink_intra --rate 200 --duration 10 \
  --rows 64 --json "$OUT/load-mooncake-nvlink.json" 2>&1 | grep -v "^[IW][0-9]" | tail -12 | tee -a "$log"
