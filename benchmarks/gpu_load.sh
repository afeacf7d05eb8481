#!/usr/bin/env bash
# kvplan load on one GPU through NIXL: a profiled probe at 400 arrivals a second (what the processes can
# sustain, and where their time goes), a decode killed mid-run, then 10,000 requests to two decode
# processes at 80% of the probe's sustained rate, with aborts and deadlines on a schedule.
# Usage (the NIXL and pyzmq wheels carried in .whl):  OUT=/some/dir bash benchmarks/gpu_load.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" .whl
log="$OUT/load.txt"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$log"
echo "\$ KVPLAN_PROFILE=prof kvplan load --rate 400 --duration 5 --rows 64" | tee -a "$log"
KVPLAN_PROFILE="$OUT/prof" timeout 100 python3 -m kvplan load --rate 400 --duration 5 --rows 64 \
  --json "$OUT/load-nixl-probe.json" 2>&1 | grep -v "^[IW][0-9]" | tail -9 | tee -a "$log"
echo "\$ kvplan load --rate 100 --duration 10 --decodes 3 --kill-at 5" | tee -a "$log"
timeout 100 python3 -m kvplan load --rate 100 --duration 10 --decodes 3 --kill-at 5 --json "$OUT/load-nixl-kill.json" \
  2>&1 | grep -v "^[IW][0-9]" | tail -10 | tee -a "$log"
rate=$(python3 -c "import json; t=json.load(open('$OUT/load-nixl-probe.json'))['throughput']; print(max(20, round(0.8 * t['requests_per_s'] / 0.875)))")
duration=$(python3 -c "print(round(10000 / $rate))")
echo "\$ kvplan load --rate $rate --duration $duration --rows 64" | tee -a "$log"
timeout 400 python3 -m kvplan load --rate $rate --duration $duration --rows 64 --json "$OUT/load-nixl-10k.json" 2>&1 \
  | grep -v "^[IW][0-9]" | tail -10 | tee -a "$log"
