#!/bin/bash
# A card call: the served rows with the load tool as it was and as it is now, interleaved, on the same library:
# .harness-old is this tree's kvplan with the tool's three files of 7ba0058 (the commit before its change):
#   mkdir -p .harness-old && git archive HEAD kvplan | tar x -C .harness-old
#   for f in load load_pools load_roles; do git show 7ba0058:kvplan/tools/$f.py > .harness-old/kvplan/tools/$f.py; done
# then the new tool traced (KVPLAN_TRACE), at 3,000 offered/s, and the llama8b row. Everything lands in
# $OUT/served.tgz.
#   bash benchmarks/probes/harness_call.sh      (carrying .whl-both and .harness-old)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
r=/tmp/r; mkdir -p $r
probe=benchmarks/probes/served_rows.sh
ROWS="tiny-1000-ipc tiny-1000-nixl" bash $probe $r old-tool=.harness-old new-tool=.
KVPLAN_TRACE=1 ROWS="tiny-1000-ipc tiny-1000-nixl" bash $probe $r/trace new-tool=.
ROWS="tiny-3000-ipc llama8b-200-nixl" bash $probe $r new-tool=.
tar czf $OUT/served.tgz -C $r .
