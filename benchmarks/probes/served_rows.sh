#!/bin/bash
# The rows of the `served` suite (benchmarks/suites.py), each run once per kvplan tree, interleaved, into OUT:
# the working tree and an older one (git archive REV kvplan | tar x -C .baseline) in the same call, so that
# before and after come from one card. ROWS picks rows by name (default: all).
#   ROWS="tiny-1000-nixl" bash benchmarks/probes/served_rows.sh OUT before=.baseline after=.
out=$1; shift; mkdir -p "$out"
common=(--fault-every 0 --forward-tokens-per-s 1e12 --timeout 5 --duration 4 --no-progress)
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo NIXL_LOG_LEVEL=WARN
export MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=65535 MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER=65535
declare -A ARGS=(
  [tiny-400-nixl]="--rate 400 --rows 64"
  [tiny-1000-nixl]="--rate 1000 --rows 64"
  [tiny-1000-ipc]="--rate 1000 --rows 64 --engine ipc"
  [tiny-3000-ipc]="--rate 3000 --rows 64 --engine ipc"
  [tiny-3000-nixl]="--rate 3000 --rows 64"
  [tiny-1000-nixl-if4]="--rate 1000 --rows 64 --in-flight 4"
  [llama8b-200-nixl]="--preset llama8b --rate 200 --rows 32 --prompt-max 2048"
)
for name in ${ROWS:-tiny-400-nixl tiny-1000-nixl tiny-1000-ipc llama8b-200-nixl tiny-3000-ipc}; do
  for pair in "$@"; do
    label=${pair%%=*}; tree=$(cd "${pair#*=}" && pwd)
    (cd "$tree" && PYTHONPATH="$tree:/tmp/site" timeout 150 python3 -m kvplan load "${common[@]}" ${ARGS[$name]} \
      --json "$out/$label-$name.json" >"$out/$label-$name.txt" 2>&1)
    echo "== $label $name (rc $?)"
    grep -E "^(completed|failed|throughput|latency|phases|caller|process CPU)" "$out/$label-$name.txt" | cut -c1-300
  done
done
