#!/bin/bash
# Session 29's device call (one NVIDIA H200): the command line as a user runs it, nothing exported (no
# TRITON_INTERPRET, no UCX_*: the tools choose loopback themselves); the counters through a load run; the
# changed tests compiled; the staged demo five times and every fault drill over the changed transport.
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-both/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT:/tmp/site
R=$OUT/r; mkdir -p $R
{
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
python3 -c 'import sys, torch, triton, numpy, zmq; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "numpy", numpy.__version__, "pyzmq", zmq.__version__)'
python3 -m pip list 2>/dev/null | grep -iE "^(nixl|mooncake|prometheus)"
env | grep -E "^(TRITON|UCX)_" || echo "(no TRITON_* or UCX_* exported)"
echo "== kvplan --version"; python3 -m kvplan --version
echo "== kvplan bench (two scenarios, 20 runs)"; timeout 240 python3 -m kvplan bench --scenario llama70b-tp8-p64 --scenario qwen3next-mamba-tp4to8-p64 --runs 20 --no-progress 2>&1 | tail -4
for args in "" "--mode staged --preset llama70b-tp8-p64 --requests 4 --prompt-len 4096" "--preset llama70b-tp8-p64-to-p16 --requests 4 --prompt-len 4096" "--preset qwen3next-mamba-tp4to8-p64 --requests 4"; do
  echo "== kvplan demo $args"; timeout 120 python3 -m kvplan demo $args 2>$R/demo-progress.txt | grep -vE "^  (descriptors|warm-up)"; tr '\r' '\n' < $R/demo-progress.txt | grep -c "/8 " ; done
echo "== the two-host demo's commands, as two processes on 127.0.0.1"
S="--requests 2 --prompt-len 1024 --no-progress"
timeout 120 python3 -m kvplan demo $S --role decode --listen 127.0.0.1:7301 > $R/role-decode.txt 2>&1 &
timeout 120 python3 -m kvplan demo $S --role prefill --peer 127.0.0.1:7301 2>&1 | grep -E "prefill side|completed|result"; wait
grep -E "decode side|completed|verification|result" $R/role-decode.txt
echo "== kvplan load with counters (--metrics-port 0)"
timeout 200 python3 -m kvplan load --rate 100 --duration 3 --no-progress --json $R/load.json --metrics-port 0 2>&1 | tail -12
python3 -c "import json; r=json.load(open('$R/load.json')); [print(w, s['requests'], s['failures'], s['latency_ms'], s['bounds_hit']) for w, s in r['stats'].items()]"
echo "== refusals (exit 2, one line and a hint)"
for a in "load --rate 0" "load --duration 3 --kill-at 9" "demo --prompt-len 7" "demo --engine mooncake --mode prepared"; do python3 -m kvplan $a; echo "exit $?"; done
} 2>&1 | tee $R/cli.txt
echo "== the changed tests, compiled on the GPU"
TRITON_INTERPRET=0 UCX_NET_DEVICES=lo KVPLAN_TEST_ENGINES=nixl timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE \
  tests/tools/test_front_door.py tests/tools/test_scenarios_doc.py tests/transport/test_stats.py tests/kernels/test_runnable.py \
  tests/transport/test_completion.py tests/transport/test_handoff.py -k "not mooncake" > $R/gpu-tests.txt 2>&1; tail -3 $R/gpu-tests.txt
