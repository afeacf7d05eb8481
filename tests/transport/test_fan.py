"""One prefill endpoint sending one batch to two decode endpoints (fan-out), one decode endpoint
receiving from two prefill endpoints (fan-in), and one decode rank gathering each request from the
two source ranks that hold its part (TP gather), through NIXL over 127.0.0.1, every byte checked
against a reference execution of the same plans. Each test's endpoints share one child process of
their own (tests/isolated.py): NIXL agents and their progress threads end with it, instead of
spinning on in pytest's process and starving the tests after them."""

import os
import threading
from dataclasses import replace

import pytest

from kvplan.planner.device.destinations import PreallocatedRequest
from kvplan.planner.contract.batch import Batch
from kvplan.planner.reference.oracle import plan_reference
from kvplan.tools.scenarios import build_batch, materialize
from kvplan.transport.control import ControlChannel
from tests.transport.pairing import pair
from kvplan.transport.endpoints import Chunk, DecodeEndpoint, PrefillEndpoint
from kvplan.transport.engines import make_engine
from kvplan.tools.verify import AddressSpace, execute
from tests.isolated import run_isolated
from tests.transport.handoff import HYBRID, MAMBA_TP8TO4

pytestmark = pytest.mark.engines

if "nixl" not in os.environ.get("KVPLAN_TEST_ENGINES", "nixl,mooncake").split(","):
    pytest.skip("NIXL is not among the engines of this run", allow_module_level=True)

TIMEOUT = 60


def scenario():
    batch = build_batch(HYBRID, 2, [40, 24], chunks=2, prefix_len=0, seed=5)
    src, src_tensors = materialize(batch.src, "cpu", seed=9)
    return batch, src, src_tensors


def decode_side(batch):
    side, tensors = materialize(batch.dsts[0], "cpu")
    return side, tensors


def expected_bytes(batch, src, src_tensors, dst_side, dst_tensors, requests, space=None):
    """The decode pools after a reference execution of ``requests``' transfers (onto ``space``, when
    given, instead of zeroed pools)."""
    transfers = tuple(t for t in batch.transfers if t.request in requests)
    real = Batch(src, (replace(dst_side, req_to_token=batch.dsts[0].req_to_token),), transfers)
    space = space or AddressSpace.of_tensors(dst_tensors, zero=True)
    execute(plan_reference(real).descriptors()[0], AddressSpace.of_tensors(src_tensors), space)
    return space


def waiting(decode):
    box = {}
    thread = threading.Thread(target=lambda: box.update(states=decode.wait()), daemon=True)
    thread.start()
    return thread, box


def chunks_of(batch, request):
    return [Chunk(t.request, t.src_row, t.start, t.fill_len, t.prompt_len, t.last, t.aux_src)
            for t in batch.transfers if t.request == request]


def published(batch, request):
    t = next(t for t in batch.transfers if t.request == request and t.last)
    return PreallocatedRequest(request, t.src_row, t.prompt_len, t.prefix_len, t.aux_dst)


def test_one_prefill_sends_one_batch_to_two_decode_endpoints():
    run_isolated(_fan_out, timeout=4 * TIMEOUT)


def test_batches_submitted_back_to_back_move_staged_to_two_decode_endpoints_at_once():
    """Each batch's staged runs to both decodes move together, each in its decode's part of the staging
    buffer and each share read from the batch's one plan; the second batch, planned while the first
    moves, starts each run once that decode's run of the first has ended. Every byte checked."""
    run_isolated(_fan_out_staged, timeout=4 * TIMEOUT)


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_one_decode_endpoint_receives_from_two_prefill_endpoints(mode):
    run_isolated(_fan_in, mode, timeout=4 * TIMEOUT)


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_one_decode_rank_gathers_each_request_from_the_two_source_ranks_that_hold_its_part(mode):
    """TP 8 -> 4 (docs/tp_state.md §4): KV heads and Mamba tensors come half from each source rank; a
    component of replicated tensors only comes from the group's first rank alone."""
    run_isolated(_tp_gather, mode, timeout=4 * TIMEOUT)


def _fan_out():
    batch, src, src_tensors = scenario()
    decodes, pools = [], []
    for k in range(2):
        side, tensors = decode_side(batch)
        decodes.append(DecodeEndpoint(side, make_engine("nixl", f"fan-out-decode-{k}"), ControlChannel(host="127.0.0.1")))
        pools.append((side, tensors))
    prefill = PrefillEndpoint(src, make_engine("nixl", "fan-out-prefill"),
                              [ControlChannel(d.channel.port, host="127.0.0.1") for d in decodes])
    pair([lambda d=d: d.register(timeout=TIMEOUT) for d in decodes], [lambda: prefill.accept(timeout=TIMEOUT)])
    for k, d in enumerate(decodes):  # req1 to the first decode endpoint, req2 to the second
        d.publish([published(batch, f"req{k + 1}")], timeout=TIMEOUT)
        prefill.receive_requests(1, timeout=TIMEOUT, peer=k)
    waits = [waiting(d) for d in decodes]
    transfers = [prefill.transfer(c, peer=k) for k in range(2) for c in chunks_of(batch, f"req{k + 1}")]
    assert prefill.send(transfers, mode="direct", timeout=TIMEOUT) == {"req1": None, "req2": None}
    for k, (thread, box) in enumerate(waits):
        thread.join(TIMEOUT)
        assert box["states"] == {f"req{k + 1}": "complete"}
        side, tensors = pools[k]
        assert expected_bytes(batch, src, src_tensors, side, tensors, {f"req{k + 1}"}).matches(tensors)


def _fan_out_staged():
    import torch

    batch = build_batch(HYBRID, 4, [40, 24, 32, 16], chunks=2, prefix_len=0, seed=7)
    src, src_tensors = materialize(batch.src, "cpu", seed=11)
    decodes, pools = [], []
    for k in range(2):
        side, tensors = decode_side(batch)
        decodes.append(DecodeEndpoint(side, make_engine("nixl", f"fan-out-staged-decode-{k}"),
                                      ControlChannel(host="127.0.0.1"), torch.zeros(1 << 20, dtype=torch.uint8)))
        pools.append((side, tensors))
    prefill = PrefillEndpoint(src, make_engine("nixl", "fan-out-staged-prefill"),
                              [ControlChannel(d.channel.port, host="127.0.0.1") for d in decodes],
                              torch.zeros(1 << 20, dtype=torch.uint8))
    pair([lambda d=d: d.register(timeout=TIMEOUT) for d in decodes], [lambda: prefill.accept(timeout=TIMEOUT)])
    mine = {0: ["req1", "req3"], 1: ["req2", "req4"]}
    for k, d in enumerate(decodes):
        d.publish([published(batch, r) for r in mine[k]], timeout=TIMEOUT)
        prefill.receive_requests(2, timeout=TIMEOUT, peer=k)
    waits = [waiting(d) for d in decodes]
    by_chunk: dict[int, list] = {0: [], 1: []}
    for k, requests in mine.items():
        for r in requests:
            for i, c in enumerate(chunks_of(batch, r)):
                by_chunk[i].append(prefill.transfer(c, peer=k))
    handles = [prefill.submit(by_chunk[i], mode="staged", timeout=TIMEOUT) for i in (0, 1)]
    for handle in handles:
        assert handle.result(timeout=TIMEOUT) == {r: None for r in ("req1", "req3", "req2", "req4")}
    assert prefill.last_mode == "staged"
    for k, (thread, box) in enumerate(waits):
        thread.join(TIMEOUT)
        assert box["states"] == {r: "complete" for r in mine[k]}
        side, tensors = pools[k]
        assert expected_bytes(batch, src, src_tensors, side, tensors, set(mine[k])).matches(tensors)
    prefill.close()


def _fan_in(mode):
    import torch

    batch, src, src_tensors = scenario()
    side, tensors = decode_side(batch)
    staging = (lambda: torch.zeros(1 << 20, dtype=torch.uint8)) if mode == "staged" else (lambda: None)
    channels = [ControlChannel(host="127.0.0.1"), ControlChannel(host="127.0.0.1")]
    decode = DecodeEndpoint(side, make_engine("nixl", "fan-in-decode"), channels, staging())
    prefills = [PrefillEndpoint(src, make_engine("nixl", f"fan-in-prefill-{k}"), ControlChannel(c.port, host="127.0.0.1"), staging())
                for k, c in enumerate(channels)]
    pair([lambda: decode.register(timeout=TIMEOUT)], [lambda p=p: p.accept(timeout=TIMEOUT) for p in prefills])
    for k, p in enumerate(prefills):  # each sender gets its own request
        decode.publish([published(batch, f"req{k + 1}")], timeout=TIMEOUT, peer=k)
        p.receive_requests(1, timeout=TIMEOUT)
    thread, box = waiting(decode)
    for k, p in enumerate(prefills):
        sent = p.send([p.transfer(c) for c in chunks_of(batch, f"req{k + 1}")], mode=mode, timeout=TIMEOUT)
        assert sent == {f"req{k + 1}": None}
    thread.join(TIMEOUT)
    assert box["states"] == {"req1": "complete", "req2": "complete"}
    assert expected_bytes(batch, src, src_tensors, side, tensors, {"req1", "req2"}).matches(tensors)
    assert len(decode.tracker) == 0 and len(decode.guard) == 0


def _tp_gather(mode):
    import torch

    batches = [build_batch(MAMBA_TP8TO4, 2, [40, 24], chunks=2, seed=5, src_rank=r) for r in (0, 1)]
    sources = [materialize(b.src, "cpu", seed=9 + r) for r, b in enumerate(batches)]
    side, tensors = decode_side(batches[0])
    staging = (lambda: torch.zeros(1 << 20, dtype=torch.uint8)) if mode == "staged" else (lambda: None)
    channels = [ControlChannel(host="127.0.0.1"), ControlChannel(host="127.0.0.1")]
    decode = DecodeEndpoint(side, make_engine("nixl", "gather-decode"), channels, staging())
    prefills = [PrefillEndpoint(src, make_engine("nixl", f"gather-prefill-{k}"), ControlChannel(c.port, host="127.0.0.1"), staging())
                for k, ((src, _), c) in enumerate(zip(sources, channels))]
    pair([lambda: decode.register(timeout=TIMEOUT)], [lambda p=p: p.accept(timeout=TIMEOUT) for p in prefills])
    decode.publish([published(batches[0], r) for r in ("req1", "req2")], timeout=TIMEOUT, peer=[0, 1])
    thread, box = waiting(decode)
    for p, batch in zip(prefills, batches):
        p.receive_requests(2, timeout=TIMEOUT)
        chunks = [c for r in ("req1", "req2") for c in chunks_of(batch, r)]
        assert p.send([p.transfer(c) for c in chunks], mode=mode, timeout=TIMEOUT) == {"req1": None, "req2": None}
    thread.join(TIMEOUT)
    assert box["states"] == {"req1": "complete", "req2": "complete"}
    space = None
    for batch, (src, src_tensors) in zip(batches, sources):
        space = expected_bytes(batch, src, src_tensors, side, tensors, {"req1", "req2"}, space)
        if batch is batches[0]:
            assert not space.matches(tensors)  # the first source rank's part alone is not the request
    assert space.matches(tensors)
    assert len(decode.tracker) == 0 and len(decode.guard) == 0
