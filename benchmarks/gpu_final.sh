#!/usr/bin/env bash
# One H200/H100, NIXL wheels carried in .whl: the full planning bench (issue 10), the host steps of plan,
# then the NIXL end-to-end table (issue 11).
# Usage on the GPU machine:  OUT=/some/dir bash benchmarks/gpu_final.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" .whl
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
timeout 200 python3 -m kvplan bench --no-progress --json "$OUT/bench.json" > "$OUT/bench.md" 2>&1
tail -14 "$OUT/bench.md"
timeout 90 python3 -m benchmarks.plan_host_steps > "$OUT/host-steps.txt" 2>&1; head -10 "$OUT/host-steps.txt"
timeout 320 bash "$(dirname "$0")/gpu_e2e.sh" nixl > /dev/null 2>&1
grep -vE "^[IEW][0-9]{4} " "$OUT/e2e-nixl.txt" | grep -E "^\\$|ceiling|steady|first batch|result"
