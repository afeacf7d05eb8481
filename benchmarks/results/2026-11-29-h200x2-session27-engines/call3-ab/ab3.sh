#!/bin/bash
# session 27 call 3: GPU tests of the transport changes, then first batch A/B (old = 414ae37) on two H200s
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo NIXL_LOG_LEVEL=WARN MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=65535 MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER=65535
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
mkdir -p /tmp/o
PYTHONPATH=$ROOT:/tmp/site KVPLAN_TEST_ENGINES=nixl timeout 260 python3 -m pytest -q -p no:cacheprovider -rfE tests/transport/test_warm_up.py tests/transport/test_completion.py tests/transport/test_nixl_lists.py tests/transport/test_decode_protocol.py tests/planner/test_pairing.py tests/transport/test_copy_graphs.py tests/transport/test_handoff.py -k "not mooncake and (staged or prepared or layer or warm or completion or lists or decode or pairing or graph)" > /tmp/o/gpu-tests.txt 2>&1; tail -5 /tmp/o/gpu-tests.txt
B="--no-progress --decode-gpu 1 --preset llama70b-tp8-p64 --layers 8 --requests 8 --prompt-len 8192"
S="--mode staged --staging-mib 512 --staging-slots 1"
NX="--engine nixl"; MC="--engine mooncake --engine-setting protocol=nvlink_intra"
run() { local code=$1; shift; local path=$ROOT; [ $code = old ] && path=$ROOT/ab_old
  echo "== $code $*"; PYTHONPATH=$path:/tmp/site timeout 120 python3 -m kvplan demo "$@" 2>&1 | grep -E "warm-up|transfer  |steady|result|Error|error" ; }
for round in 1 2; do for code in old new; do run $code $NX $B $S --repeat 6; done; done
for code in old new; do run $code $MC $B $S --repeat 6; done
for code in old new; do run $code $NX $B --mode prepared --repeat 4; done
echo "== traced new nixl"; KVPLAN_TRACE=1 PYTHONPATH=$ROOT:/tmp/site timeout 120 python3 -m kvplan demo $NX $B $S --repeat 3 > /tmp/o/traced-nixl.txt 2>&1; grep -E "transfer  |steady|result" /tmp/o/traced-nixl.txt
echo "== traced new mooncake"; KVPLAN_TRACE=1 PYTHONPATH=$ROOT:/tmp/site timeout 120 python3 -m kvplan demo $MC $B $S --repeat 3 > /tmp/o/traced-mooncake.txt 2>&1; grep -E "transfer  |steady|result" /tmp/o/traced-mooncake.txt
tar czf $OUT/o.tgz -C /tmp o
