"""A prefill-to-decode hand-off through NIXL inside one process, on 127.0.0.1, checked byte for byte.

Run: ``UCX_NET_DEVICES=lo python examples/handoff_in_process.py`` (without a GPU, also
``TRITON_INTERPRET=1``). Real deployments run the two endpoints in two processes (see
``kvplan/tools/demo.py``); here the decode side registers and waits in threads, as its own process would:
each end of a control channel proves the secret (on loopback, this user's loopback secret) before the
other sends it anything, so the two ends must be served at once, never one after the other on one thread.
"""

import os
import threading
import time
from dataclasses import replace

from kvplan.planner.device.destinations import PreallocatedRequest
from kvplan.planner.contract.batch import Batch
from kvplan.planner.reference.oracle import plan_reference
from kvplan.tools.scenarios import PRESETS, build_batch, materialize
from kvplan.transport.control import ControlChannel
from kvplan.transport.endpoints import Chunk, DecodeEndpoint, PrefillEndpoint
from kvplan.transport.engines import make_engine
from kvplan.tools.verify import AddressSpace, execute

os.environ.setdefault("UCX_NET_DEVICES", "lo")
batch = build_batch(PRESETS["qwen3next-mamba-p64"].scaled(layers=2), requests=2, prompt_len=[256, 130], chunks=2)
prefill_side, prefill_memory = materialize(batch.src, seed=1)      # pools with known bytes
decode_side, decode_memory = materialize(batch.dsts[0])            # empty pools

# decode side: register, publish where each request's pages and state go
decode = DecodeEndpoint(decode_side, make_engine("nixl", "decode"), ControlChannel(host="127.0.0.1"))
prefill = PrefillEndpoint(prefill_side, make_engine("nixl", "prefill"), ControlChannel(decode.channel.port, host="127.0.0.1"))
registering = threading.Thread(target=decode.register, kwargs={"timeout": 30})
registering.start()
prefill.accept(timeout=30)
registering.join(30)
finals = {t.request: t for t in batch.transfers if t.last}
decode.publish([PreallocatedRequest(r, t.src_row, t.prompt_len, t.prefix_len, t.aux_dst) for r, t in finals.items()],
               timeout=30)
states = {}
waiter = threading.Thread(target=lambda: states.update(decode.wait()))
waiter.start()

# prefill side: take the lists, plan the chunks, move them
prefill.receive_requests(len(finals), timeout=30)
chunks = [Chunk(t.request, t.src_row, t.start, t.fill_len, t.prompt_len, t.last, t.aux_src) for t in batch.transfers]
t0 = time.perf_counter()
sent = prefill.send([prefill.transfer(c) for c in chunks], timeout=30)
waiter.join(60)

# check every byte against the reference plan executed on host copies
expected = AddressSpace.of_tensors(decode_memory, zero=True)
real = Batch(prefill_side, (replace(decode_side, req_to_token=batch.dsts[0].req_to_token),), batch.transfers)
execute(plan_reference(real).descriptors()[0], AddressSpace.of_tensors(prefill_memory), expected)
ok = all(v is None for v in sent.values()) and set(states.values()) == {"complete"} and expected.matches(decode_memory)
print(f"sent {sent}, decode states {states}, {prefill.last_mode} mode, "
      f"{(time.perf_counter() - t0) * 1e3:.0f} ms: {'every byte matches' if ok else 'FAILED'}")
raise SystemExit(0 if ok else 1)
