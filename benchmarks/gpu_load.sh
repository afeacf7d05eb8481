#!/usr/bin/env bash
# kvplan load on one GPU through NIXL: a profiled short run at 200 arrivals a second (where the time
# goes), a decode killed mid-run, the wait loops' pause (kvplan.transport.pause) against spinning on the
# staged demo's steady batch, then 10,000 requests (50 a second for 200 s) to two decode processes with
# aborts and deadlines on a schedule.
# Usage (the NIXL and pyzmq wheels carried in .whl):  OUT=/some/dir bash benchmarks/gpu_load.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" .whl
log="$OUT/load.txt"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$log"
echo "\$ KVPLAN_PROFILE=prof kvplan load --rate 200 --duration 5 --rows 64" | tee -a "$log"
KVPLAN_PROFILE="$OUT/prof" timeout 100 python3 -m kvplan load --rate 200 --duration 5 --rows 64 2>&1 \
  | grep -v "^[IW][0-9]" | tail -9 | tee -a "$log"
echo "\$ kvplan load --rate 50 --duration 10 --decodes 3 --kill-at 5" | tee -a "$log"
timeout 100 python3 -m kvplan load --rate 50 --duration 10 --decodes 3 --kill-at 5 --json "$OUT/load-nixl-kill.json" \
  2>&1 | grep -v "^[IW][0-9]" | tail -10 | tee -a "$log"
batch="--preset llama70b-tp8-p64 --layers 8 --requests 8 --prompt-len 8192 --repeat 12 --mode staged"
for hot in 0.002 1000; do
  echo "\$ KVPLAN_HOT_S=$hot kvplan demo $batch" | tee -a "$log"
  KVPLAN_HOT_S=$hot timeout 90 python3 -m kvplan demo --no-progress $batch 2>&1 | grep -v "^[IW][0-9]" | tee -a "$log"
done
echo "\$ kvplan load --rate 50 --duration 200 --rows 64" | tee -a "$log"
timeout 330 python3 -m kvplan load --rate 50 --duration 200 --rows 64 --json "$OUT/load-nixl-10k.json" 2>&1 \
  | grep -v "^[IW][0-9]" | tail -10 | tee -a "$log"
