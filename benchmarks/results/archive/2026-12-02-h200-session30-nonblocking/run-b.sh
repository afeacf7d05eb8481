#!/bin/bash
# Session 30's second device call: what failed at 1000/s in the first (every request "the prefill side is gone"):
# the whole report and the problems, now and before; a profile of each process at 250/s.
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R/prof
NOW="env PYTHONPATH=$ROOT:/tmp/site python3 -m kvplan"
BEFORE="env PYTHONPATH=$ROOT/.before53:/tmp/site python3 -m kvplan"
RUN="load --forward-tokens-per-s 1e12 --rows 64 --fault-every 0 --duration 4 --timeout 5 --no-progress"
timeout 90 $NOW $RUN --rate 1000 --json $R/now-1000.json > $R/now-1000.txt 2>&1
timeout 90 $BEFORE $RUN --rate 1000 --json $R/before-1000.json > $R/before-1000.txt 2>&1
KVPLAN_PROFILE=$R/prof timeout 90 $NOW $RUN --rate 250 --json $R/now-250.json > $R/now-250.txt 2>&1
python3 - <<PY > $R/b.txt 2>&1
import json, collections
for name in ("now-1000", "before-1000", "now-250"):
    r = json.load(open("$R/%s.json" % name))
    print("==", name, "completed", r["completed"], "of", r["requests"], r["throughput"], r["latency_ms"], r["failures"])
    print("   caller", r.get("caller_us_per_request"))
    reasons = collections.Counter(p.split(": ", 1)[-1][:160] for p in r["problems"])
    for why, n in reasons.most_common(8):
        print("  ", n, why)
    for who, snap in r["stats"].items():
        print("  ", who, {k: snap.get(k) for k in ("requests", "failures", "bounds_hit", "latency_ms")})
PY
ls $R/prof; grep -v "^request '" $R/now-1000.txt | head -30; cat $R/b.txt
