"""SGLang 0.5.23's own scheduler-side queues make kvplan's classes.

In a fresh process, as SGLang's prefill scheduler runs: its runtime configuration published, the
plugins loaded with ``KVPLAN_SGLANG=1``, SGLang's own bootstrap server up, then SGLang's real
``PrefillBootstrapQueue`` over SGLang's real ``MHATokenToKVPool`` (CPU), ``MetadataBuffers`` and
``ReqToMetadataIdxAllocator``, with a stand-in scheduler object for what the queue reads of it. The
queue's ``_init_kv_manager`` fills SGLang's ``KVArgs`` and builds kvplan's manager, which must take
its port and host from SGLang's published configuration (its ``ServerArgs`` attributes keep their
defaults there) and register its rank with SGLang's server. A kvplan decode manager then finds the
prefill's layout there, and SGLang's own ``DecodePreallocQueue._resolve_prefill_dp_rank`` (which
crashed on a manager without ``prefill_info_table``) resolves the request's prefill DP rank.

Requests driven through the queues' pop paths, several ranks and aborts: test_sglang_scheduler_queues.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sglang_real import sglang_module

pytestmark = [pytest.mark.sglang, pytest.mark.engines]
ROOT = Path(__file__).resolve().parents[2]

_SCHEDULER = r"""
import json, os, socket, sys, time, types
sys.path.insert(0, {root!r})
from tests.sglang_real import _stand_ins
_stand_ins()
import torch
from sglang.srt import runtime_context as ctx
from sglang.srt.disaggregation import decode, prefill, utils
from sglang.srt.mem_cache import memory_pool
from sglang.srt.plugins import load_plugins

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
PAGE = 4
server_args = ctx.get_context().override_server_args(
    disaggregation_mode="prefill", disaggregation_transfer_backend="nixl", disaggregation_bootstrap_port=port,
    host="127.0.0.1", page_size=PAGE, device="cpu", tp_size=1, max_running_requests=8, context_length=256).install()
ctx.get_parallel().override_permanently(tp_rank=0, pp_rank=0, dp_rank=0, attn_tp_rank=0, attn_cp_rank=0,
                                        attn_dcp_rank=0, attn_dp_rank=0, pp_group=None)
load_plugins()
server = utils.get_kv_class(utils.TransferBackend.NIXL, utils.KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", port)
pool = memory_pool.MHATokenToKVPool(size=256, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=8,
                                    layer_num=2, device="cpu", enable_memory_saver=False)
scheduler = types.SimpleNamespace(
    tp_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(effective_logical_max_total_num_tokens=256,
                                                                       kv_cache_dtype_str="auto")),
    kv_shard_widening=1, token_to_kv_pool_allocator=types.SimpleNamespace(page_size=PAGE), rust_server=None,
    model_config=types.SimpleNamespace(num_hidden_layers=2, get_total_num_kv_heads=lambda: 2,
                                       hf_text_config=types.SimpleNamespace()),
    server_args=server_args)
queue = prefill.PrefillBootstrapQueue(
    pool, None, utils.ReqToMetadataIdxAllocator(8),
    utils.MetadataBuffers(size=8, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=0),
    gpu_id=0, bootstrap_port=port, max_total_num_tokens=256, scheduler=scheduler, scheduler_stage_metrics=None,
    transfer_backend=utils.TransferBackend.NIXL)
mgr = queue.kv_manager
out = {{"manager": f"{{type(mgr).__module__}}.{{type(mgr).__name__}}", "listener": [mgr.host, mgr.listener.port],
        "bootstrap": [mgr.bootstrap_host, mgr.bootstrap_port, port], "entries": len(mgr.kv_args.kv_data_ptrs)}}
from kvplan.integrations.sglang.bootstrap import prefill_rank
out["registered"] = list(prefill_rank("127.0.0.1", port, tp_rank=0))
decoder = type(mgr)(queue.kv_manager.kv_args, utils.DisaggregationMode.DECODE, server_args)
out["first_look"] = decoder.try_ensure_parallel_info(f"127.0.0.1:{{port}}")  # (starts the lookup off-thread)
until = time.monotonic() + 30
while not decoder.try_ensure_parallel_info(f"127.0.0.1:{{port}}") and time.monotonic() < until:
    time.sleep(0.01)  # (SGLang looks again a second later)
out["layout"] = decoder.try_ensure_parallel_info(f"127.0.0.1:{{port}}")
req = types.SimpleNamespace(bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=5,
                            disagg_prefill_dp_rank=None)
out["dp_rank"] = decode.DecodePreallocQueue._resolve_prefill_dp_rank(types.SimpleNamespace(kv_manager=decoder), req)
decoder.close()
mgr.close()
server.close()
print(json.dumps(out))
"""


def test_sglang_s_prefill_queue_builds_kvplan_s_manager_and_its_decode_finds_it():
    sglang_module("srt.disaggregation.base.conn")  # skips where SGLang is not installed
    env = {**os.environ, "KVPLAN_SGLANG": "1", "KVPLAN_HOST": "127.0.0.1", "UCX_NET_DEVICES": "lo",
           "SGLANG_HOST_IP": "127.0.0.1"}
    done = subprocess.run([sys.executable, "-c", _SCHEDULER.format(root=str(ROOT))], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["manager"] == "kvplan.integrations.sglang.adapter.KVManager"
    host, listener_port = out["listener"]
    bootstrap_host, bootstrap_port, port = out["bootstrap"]
    assert (host, bootstrap_host, bootstrap_port) == ("127.0.0.1", "127.0.0.1", port)  # SGLang's published port
    assert listener_port != port  # SGLang's bootstrap server keeps its port
    assert out["registered"] == ["127.0.0.1", listener_port]  # found through SGLang's server
    assert out["entries"] == 4  # SGLang's KVArgs: K and V of 2 layers
    assert out["first_look"] is False  # the first look never waits for the server: it starts the lookup
    assert out["layout"] is True and out["dp_rank"] == 0
