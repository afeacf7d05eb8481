#!/bin/bash
# session 27 A/B: old = 414ae37 (session 26), new = the working tree; two H200s
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo NIXL_LOG_LEVEL=WARN
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
B="--no-progress --decode-gpu 1 --preset llama70b-tp8-p64 --layers 8 --requests 8 --prompt-len 8192 --mode staged --staging-mib 512 --staging-slots 1"
NX="--engine nixl"; MC="--engine mooncake --engine-setting protocol=nvlink_intra"
run() { local code=$1; shift; local path=$ROOT; [ $code = old ] && path=$ROOT/ab_old
  echo "== $code $*"; PYTHONPATH=$path:/tmp/site timeout 120 python3 -m kvplan demo "$@" 2>&1 | grep -E "warm-up|transfer  |steady|spread|result|Error|error" ; }
for round in 1 2; do
  for code in old new; do run $code $NX $B --repeat 12; done
  for code in old new; do run $code $MC $B --repeat 12; done
done
mkdir -p /tmp/o
for e in nixl mooncake; do E=$NX; [ $e = mooncake ] && E=$MC
  echo "== traced new $e"; KVPLAN_TRACE=1 PYTHONPATH=$ROOT:/tmp/site timeout 120 python3 -m kvplan demo $E $B --repeat 4 > /tmp/o/traced-$e.txt 2>&1; grep -E "transfer  |steady|result" /tmp/o/traced-$e.txt
done
echo "== traced new nixl 256x4"; KVPLAN_TRACE=1 PYTHONPATH=$ROOT:/tmp/site timeout 120 python3 -m kvplan demo $NX ${B/--staging-mib 512 --staging-slots 1/--staging-mib 256 --staging-slots 4} --repeat 4 > /tmp/o/traced-nixl-256x4.txt 2>&1; grep -E "transfer  |steady|result" /tmp/o/traced-nixl-256x4.txt
echo "== profiled first batch, new nixl"; KVPLAN_PROFILE=/tmp/o/prof-first KVPLAN_TRACE=1 PYTHONPATH=$ROOT:/tmp/site timeout 120 python3 -m kvplan demo $NX $B --repeat 1 > /tmp/o/prof-first.txt 2>&1; grep -E "transfer  |steady|result" /tmp/o/prof-first.txt
echo "== profiled 12 batches, new nixl"; KVPLAN_PROFILE=/tmp/o/prof-steady PYTHONPATH=$ROOT:/tmp/site timeout 120 python3 -m kvplan demo $NX $B --repeat 12 > /tmp/o/prof-steady.txt 2>&1; grep -E "transfer  |steady|result" /tmp/o/prof-steady.txt
tar czf $OUT/o.tgz -C /tmp o
