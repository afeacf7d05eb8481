#!/usr/bin/env bash
# Staged mode through NIXL on one GPU, traced and profiled: where each wave's time goes.
# Usage on the GPU machine (NIXL and pyzmq wheels carried in .whl):
#   OUT=/some/dir bash benchmarks/gpu_staged.sh [MIB:SLOTS ...]     (default: 64:4 256:4 256:2)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo NIXL_LOG_LEVEL=WARN TRITON_INTERPRET=0
OUT=${OUT:-/tmp/kvplan-gpu}; mkdir -p "$OUT"
log="$OUT/staged.txt"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$log"
for spec in "${@:-64:4 256:4 256:2}"; do
  for one in $spec; do
    mib=${one%%:*}; slots=${one##*:}
    echo "\$ kvplan demo --mode staged --staging-mib $mib --staging-slots $slots (profiled)" | tee -a "$log"
    rm -rf /tmp/prof
    KVPLAN_PROFILE=/tmp/prof timeout 300 python3 -m kvplan demo --no-progress --engine nixl --mode staged \
      --staging-mib "$mib" --staging-slots "$slots" --preset llama70b-tp8-p64 --layers 8 --requests 8 \
      --prompt-len 8192 --repeat 12 2>&1 | tee -a "$log"
    for side in prefill decode; do echo "== $side profile"; head -60 /tmp/prof/$side.txt; done >> "$log"
    echo "\$ the same, traced (unprofiled)" | tee -a "$log"
    KVPLAN_TRACE=1 timeout 300 python3 -m kvplan demo --no-progress --engine nixl --mode staged \
      --staging-mib "$mib" --staging-slots "$slots" --preset llama70b-tp8-p64 --layers 8 --requests 8 \
      --prompt-len 8192 --repeat 4 2>&1 | tail -14 >> "$log"
  done
done
