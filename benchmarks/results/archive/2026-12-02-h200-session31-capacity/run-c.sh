#!/bin/bash
# Session 31's third device call: after the control channel's change, the staged demo three times in a row and
# the staged fault drills (as session 30's run-d.sh), one text file.
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT:/tmp/site
B="--no-progress --engine nixl --preset llama70b-tp8-p64 --layers 4 --requests 4 --prompt-len 4096"
{
for i in 1 2 3; do echo "== staged $i ($SECONDS s)"; timeout 60 python3 -m kvplan demo $B --mode staged --repeat 8 2>&1 | grep -E "completed|verification|result"; done
for f in dead-decode dead-prefill dead-decode-mid dead-prefill-mid bad-registration deadline; do
  echo "== drill staged $f ($SECONDS s)"; timeout 30 python3 -m kvplan demo $B --mode staged --fault $f 2>&1 | grep -E "fault|observed|expected" | tail -2
done
echo "== end ($SECONDS s)"
} > $OUT/c.txt 2>&1
cat $OUT/c.txt
