"""kvplan under SGLang's disaggregation interfaces: a prefill and a decode node's KV managers, one
request sent in two chunks through NIXL on 127.0.0.1, checked byte for byte.

This is the code an SGLang deployment runs in its schedulers once ``KVPLAN_SGLANG=1`` switches kvplan
on (docs/sglang.md): ``KVArgs`` as SGLang fills them, a ``KVManager`` per side, a ``KVSender`` /
``KVReceiver`` per request, polled for SGLang's ``KVPoll`` states; SGLang's own bootstrap server, where
the prefill rank registers and the decode finds it. Here both sides run in one process (the decode side
in a thread) on host memory, bound to 127.0.0.1.

Run, where SGLang 0.5.23 is installed with its dependencies::

    UCX_NET_DEVICES=lo python examples/sglang_integration.py

With the CPU environment of ``make setup-sglang`` (SGLang without its GPU kernels and without torchvision,
which SGLang's multimodal imports ask for; ``tests/sglang_real.py`` answers that import)::

    UCX_NET_DEVICES=lo TRITON_INTERPRET=1 .venv-sglang/bin/python -m tests.sglang_real examples/sglang_integration.py
"""

import os
import socket
import threading
import time
from types import SimpleNamespace

import torch
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

from kvplan.integrations.sglang import KVManager, KVReceiver, KVSender

os.environ.setdefault("UCX_NET_DEVICES", "lo")
PAGE_SIZE, PAGES, TOKEN_BYTES, LAYERS = 16, 64, 128, 2
DONE = (KVPoll.Success, KVPoll.Failed)


def kv_args(pools: list[torch.Tensor], aux: torch.Tensor) -> KVArgs:
    """What SGLang's scheduler registers: one buffer per layer's K and V, one aux buffer."""
    args = KVArgs()
    args.kv_data_ptrs, args.kv_data_lens = [t.data_ptr() for t in pools], [t.numel() for t in pools]
    args.kv_item_lens = [PAGE_SIZE * TOKEN_BYTES] * len(pools)
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [aux.data_ptr()], [aux.numel()], [64]
    args.page_size, args.engine_rank, args.kv_head_num, args.total_kv_head_num = PAGE_SIZE, 0, 1, 1
    args.state_types, args.prefill_start_layer = [], 0
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


port = free_port()
# SGLang's server args (a deployment's come from its command line); kvplan_* as KVPLAN_* variables would give them
server_args = SimpleNamespace(disaggregation_transfer_backend="nixl", disaggregation_bootstrap_port=port,
                              host="127.0.0.1", max_running_requests=8, context_length=1024,
                              kvplan_mode="direct", kvplan_host="127.0.0.1")
# SGLang's own bootstrap server, as an SGLang prefill node starts it
bootstrap = get_kv_class(TransferBackend.NIXL, KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", port)
room, src_pages, dst_pages = 42, [7, 3, 12, 13, 14], [30, 31, 32, 5, 9]  # a 70-token prompt: 5 pages

# prefill node: pools with known bytes
torch.manual_seed(0)
src_kv = [torch.randint(0, 256, (PAGES * PAGE_SIZE * TOKEN_BYTES,), dtype=torch.uint8) for _ in range(2 * LAYERS)]
src_aux = torch.randint(0, 256, (16 * 64,), dtype=torch.uint8)
prefill = KVManager(kv_args(src_kv, src_aux), DisaggregationMode.PREFILL, server_args)

# decode node: empty pools; it publishes where the request goes, then waits for it
dst_kv = [torch.zeros(PAGES * PAGE_SIZE * TOKEN_BYTES, dtype=torch.uint8) for _ in range(2 * LAYERS)]
dst_aux = torch.zeros(16 * 64, dtype=torch.uint8)
decode_states = []


def decode_node() -> None:
    decode = KVManager(kv_args(dst_kv, dst_aux), DisaggregationMode.DECODE, server_args)
    receiver = KVReceiver(decode, f"127.0.0.1:{port}", room)
    deadline = time.monotonic() + 60
    while not decode.try_ensure_parallel_info(f"127.0.0.1:{port}") and time.monotonic() < deadline:
        time.sleep(0.05)  # as SGLang's decode scheduler does: the prefill's layout first, then init
    receiver.init(prefill_dp_rank=0)
    receiver.send_metadata(torch.tensor(dst_pages, dtype=torch.int32), aux_index=6)
    deadline = time.monotonic() + 60
    while (state := receiver.poll()) not in DONE and time.monotonic() < deadline:
        time.sleep(0.001)
    decode_states.append(state)
    decode.close()  # the engine, its registrations and the control channel


thread = threading.Thread(target=decode_node)
thread.start()
sender = KVSender(prefill, f"127.0.0.1:{port}", room)
sender.init(num_kv_indices=len(src_pages), aux_index=2)
deadline = time.monotonic() + 60
while sender.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:  # until the decode's lists arrive
    time.sleep(0.01)
sender.send(torch.tensor(src_pages[:2], dtype=torch.int32))  # chunk 1 (one scheduler step)
print("after chunk 1: poll", sender.poll(), f"(Transferring is {KVPoll.Transferring})")
sender.send(torch.tensor(src_pages[2:], dtype=torch.int32))  # chunk 2, the last: aux goes with it
while (state := sender.poll()) not in DONE and time.monotonic() < deadline:
    time.sleep(0.01)
thread.join(timeout=60)
prefill.close()
bootstrap.close()

item = PAGE_SIZE * TOKEN_BYTES
same = all(torch.equal(s[sp * item:(sp + 1) * item], d[dp * item:(dp + 1) * item])
           for s, d in zip(src_kv, dst_kv) for sp, dp in zip(src_pages, dst_pages))
same &= torch.equal(src_aux[2 * 64:3 * 64], dst_aux[6 * 64:7 * 64])
print(f"prefill poll: {state} (Success is {KVPoll.Success}); decode poll: {decode_states}")
print("every byte matches" if same and state == KVPoll.Success and decode_states == [KVPoll.Success]
      else "MISMATCH")
