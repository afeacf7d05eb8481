# Sourced by the GPU scripts (benchmarks/gpu_*.sh) on the GPU machine: installs the engine wheels
# carried in the folder given as $1 (default .whl: NIXL; .whl-mc: Mooncake) into /tmp/site, exports
# what every run needs (loopback only, compiled kernels), and makes $OUT. Exits the caller when the
# wheels do not install.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${1:-.whl}"/*.whl \
  || exit 1
export PYTHONPATH=.:/tmp/site TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo NIXL_LOG_LEVEL=WARN
export MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=65535 MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER=65535
OUT=${OUT:-/tmp/kvplan-gpu}; mkdir -p "$OUT"
python3 -c 'import zmq' || { echo "pyzmq is missing: carry its cp312 wheel in $1 with the engine's"; exit 1; }
