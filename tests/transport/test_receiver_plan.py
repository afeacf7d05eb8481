"""Staged runs whose scatter the receiver plans from its own lists (kvplan.transport.receiver_plan).

* the receiver's plan of a run, from its side to itself, puts every byte of the sender's stream at
  the same destination address as the sender's plan, for every state kind, chunking and prefix;
* only pairings that move whole destination items of equal size are planned by the receiver;
* on the receiver: a planned run is scattered wave by wave (runs cut at wave boundaries), and a
  run whose chunks or bytes disagree with what this side published is refused with nothing written.
"""

import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvplan.planner.device.destinations import PreallocatedRequest, plan_destinations
from kvplan.planner.contract.batch import Attention, Batch, Entry, KVLayout, Policy, SideMemory
from kvplan.planner.reference.oracle import plan_reference
from kvplan.tools.scenarios import PRESETS, build_batch
from kvplan.transport.decode import DecodeEndpoint
from kvplan.transport.local import plan_alignment
from kvplan.transport.registration import describe_side
from kvplan.transport.receiver_plan import OwnLists, fills_whole_items, receiver_can_plan, run_columns, scatter_source
from kvplan.transport.waves import wave_note
from tests.planner.builders import table_with
from tests.transport.handoff import MAMBA_TP4TO8, MAMBA_TP8TO4
from tests.transport.fakes import FakeChannel, FakeEngine

SHAPES = ["llama70b-tp8-p64", "gptoss-swa-p16", "dsv32-mla-dsa-p64", "qwen3next-mamba-p64"]


def _byte_stream(descs: np.ndarray, unit: int) -> np.ndarray:
    """The destination address of every ``unit`` bytes of a plan's byte stream, in stream order."""
    dst, size = descs[:, 1].astype(np.int64), descs[:, 2].astype(np.int64) // unit
    first = np.repeat(np.cumsum(size) - size, size)
    return np.repeat(dst, size) + (np.arange(int(size.sum())) - first) * unit


def _receiver_batch(batch: Batch) -> Batch:
    """What the receiver plans for ``batch``: its own transfers of the same chunks, from what it
    published, from the side :func:`scatter_source` names (its own, or the sender's mirror)."""
    dst = batch.dsts[0]
    source = scatter_source(batch.src, dst, Policy.STRICT)
    assert source is not None
    lasts = {t.request: t for t in batch.transfers if t.last}
    allocated = {r: PreallocatedRequest(r, t.src_row, t.prompt_len, t.prefix_len, t.aux_dst) for r, t in lasts.items()}
    own = {p.request: OwnLists.of(allocated[p.request], p)
           for p in plan_destinations(dst, list(allocated.values())).result()}
    columns = run_columns([(t.request, t.start, t.fill_len, t.last) for t in batch.transfers], own.__getitem__)
    return Batch(source, (dst,), tuple(columns.transfer(t) for t in range(columns.num_transfers)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunks, prefix_pages, seed", [(1, 0, 1), (3, 0, 2), (2, 1, 3)])
def test_the_receiver_plans_the_bytes_the_sender_sends(shape, chunks, prefix_pages, seed):
    model = PRESETS[shape].scaled(layers=2)
    batch = build_batch(model, 3, [64 * 6, 64 * 4 + 17, 64 * 5], chunks=chunks, prefix_len=prefix_pages * 64,
                        seed=seed)
    assert receiver_can_plan(batch.src, batch.dsts[0], Policy.STRICT)
    sent = plan_reference(batch).descriptors()[0]
    own = plan_reference(_receiver_batch(batch)).descriptors()[0]
    assert len(own) <= len(sent)  # its runs break only where the destination breaks
    unit = int(np.gcd.reduce(np.concatenate([sent[:, 1:], own[:, 1:]]).astype(np.int64).ravel()))
    assert np.array_equal(_byte_stream(sent, unit), _byte_stream(own, unit))


# TP scatter (source TP below the destination's): each source rank sends a destination rank every
# head it holds, one descriptor per token, and those tokens are the destination's pages whole
SCATTERS = [("llama70b-tp8-p64", 4, 8, 1, 3), ("llama70b-tp8-p64", 2, 8, 1, 7), ("gptoss-swa-p16", 4, 8, 3, 6),
            ("gptoss-swa-p16", 8, 8, 5, 5)]


@pytest.mark.parametrize("shape, src_tp, dst_tp, src_rank, dst_rank", SCATTERS)
@pytest.mark.parametrize("chunks, prefix_pages, seed", [(1, 0, 4), (3, 1, 5)])
def test_the_receiver_plans_the_bytes_of_a_tp_scatter(shape, src_tp, dst_tp, src_rank, dst_rank, chunks,
                                                       prefix_pages, seed):
    model = PRESETS[shape].scaled(layers=2).with_tp(src_tp, dst_tp)
    ps = model.page_size
    batch = build_batch(model, 3, [ps * 6, ps * 4 + 3, ps * 5], chunks=chunks, prefix_len=prefix_pages * ps,
                        seed=seed, src_rank=src_rank, dst_rank=dst_rank)
    assert receiver_can_plan(batch.src, batch.dsts[0], Policy.STRICT)
    sent = plan_reference(batch).descriptors()[0]
    own = plan_reference(_receiver_batch(batch)).descriptors()[0]
    assert len(own) < len(sent) or src_tp == dst_tp  # per token against page runs
    unit = int(np.gcd.reduce(np.concatenate([sent[:, 1:], own[:, 1:]]).astype(np.int64).ravel()))
    assert np.array_equal(_byte_stream(sent, unit), _byte_stream(own, unit))


def test_a_wrong_order_would_be_seen():
    """The comparison above can fail: the same descriptors in another order give another stream."""
    batch = build_batch(PRESETS["llama70b-tp8-p64"].scaled(layers=2), 2, 64 * 4, seed=5)
    sent = plan_reference(batch).descriptors()[0]
    unit = int(np.gcd.reduce(sent[:, 1:].astype(np.int64).ravel()))
    assert not np.array_equal(_byte_stream(sent, unit), _byte_stream(sent[::-1], unit))


@pytest.mark.parametrize("change, plans", [
    (dict(), "whole"),
    (dict(tp=(4, 8)), "whole"),  # head-sliced KV and SWA, every head a destination rank holds: whole tokens
    (dict(tp=(8, 4)), "mirror"),  # a gather: each source rank fills half of each destination token
    (dict(dst_page_size=64), None),  # pages of another size
    (dict(policy=Policy.TRUNCATE), None),  # the sender may send shorter lists than published
])
def test_what_the_receiver_plans_a_pairing_s_scatter_from(change, plans):
    model = PRESETS["gptoss-swa-p16"].scaled(layers=2)
    if "tp" in change:
        model = model.with_tp(*change["tp"])
    ranks = {(4, 8): (1, 2), (8, 4): (3, 1)}.get(change.get("tp"), (0, 0))
    batch = build_batch(model, 1, 64, dst_page_size=change.get("dst_page_size"), src_rank=ranks[0], dst_rank=ranks[1])
    source = scatter_source(batch.src, batch.dsts[0], change.get("policy", Policy.STRICT))
    assert receiver_can_plan(batch.src, batch.dsts[0], change.get("policy", Policy.STRICT)) is (plans is not None)
    assert {None: source is None, "whole": source is batch.dsts[0],
            "mirror": source is not None and source.kv.tp_rank == 3 and source.req_to_token is batch.dsts[0].req_to_token
            }[plans]


@pytest.mark.parametrize("shape", [MAMBA_TP4TO8, PRESETS["qwen3next-mamba-p64"].scaled(layers=2).with_tp(4, 8)])
@pytest.mark.parametrize("src_rank, dst_rank", [(1, 2), (1, 3), (3, 7)])
def test_the_receiver_plans_tp_sliced_mamba_state_of_a_tp_scatter(shape, src_rank, dst_rank):
    """Each entry's blocks (docs/tp_state.md §4: a GDN conv's query, key and value parts) fill the
    destination item back to back, and a request has one slot: its state streams as whole items."""
    batch = build_batch(shape, 3, [shape.page_size * 6, shape.page_size * 4 + 3, 17], chunks=2, seed=8,
                        src_rank=src_rank, dst_rank=dst_rank)
    assert receiver_can_plan(batch.src, batch.dsts[0], Policy.STRICT)
    sent = plan_reference(batch).descriptors()[0]
    own = plan_reference(_receiver_batch(batch)).descriptors()[0]
    unit = int(np.gcd.reduce(np.concatenate([sent[:, 1:], own[:, 1:]]).astype(np.int64).ravel()))
    assert np.array_equal(_byte_stream(sent, unit), _byte_stream(own, unit))


@pytest.mark.parametrize("src_rank", [0, 1])
def test_a_tp_gather_does_not_fill_whole_items(src_rank):
    """Each source rank fills part of each destination item (and the second one none of a replicated
    one). With MLA the KV moves whole, so the state alone decides."""
    mla = replace(MAMBA_TP8TO4, attention=Attention.MLA, num_kv_heads=1)
    assert fills_whole_items(*_sides(replace(mla, src_tp=4, dst_tp=8), 1, 2)[:2])  # the scatter does
    assert not fills_whole_items(*_sides(mla, src_rank, 0)[:2])
    assert not fills_whole_items(*_sides(MAMBA_TP8TO4, src_rank, 0)[:2])


# TP gather (source TP above the destination's): each source rank fills its part of each destination
# item; the receiver plans each sender's runs from that sender's layout over its own lists
GATHERS = [(MAMBA_TP8TO4, 0, 0), (MAMBA_TP8TO4, 1, 0), (replace(MAMBA_TP8TO4, attention=Attention.MLA, num_kv_heads=1), 1, 0),
           (PRESETS["llama70b-tp8-p64"].scaled(layers=2).with_tp(8, 4), 5, 2),
           (PRESETS["gptoss-swa-p16"].scaled(layers=2).with_tp(8, 2), 6, 1),
           (PRESETS["qwen3next-mamba-p64"].scaled(layers=2).with_tp(8, 4), 3, 1)]


@pytest.mark.parametrize("shape, src_rank, dst_rank", GATHERS)
@pytest.mark.parametrize("chunks, prefix_pages, seed", [(1, 0, 6), (3, 1, 7)])
def test_the_receiver_plans_the_bytes_of_a_tp_gather_from_the_sender_s_layout(shape, src_rank, dst_rank, chunks,
                                                                               prefix_pages, seed):
    ps = shape.page_size
    batch = build_batch(shape, 3, [ps * 6, ps * 4 + 3, ps * 5], chunks=chunks, prefix_len=prefix_pages * ps,
                        seed=seed, src_rank=src_rank, dst_rank=dst_rank)
    assert not fills_whole_items(batch.src, batch.dsts[0])
    sent = plan_reference(batch).descriptors()[0]
    own = plan_reference(_receiver_batch(batch)).descriptors()[0]
    unit = int(np.gcd.reduce(np.concatenate([sent[:, 1:], own[:, 1:]]).astype(np.int64).ravel()))
    assert np.array_equal(_byte_stream(sent, unit), _byte_stream(own, unit))


def _sides(shape, src_rank, dst_rank):
    batch = build_batch(shape, 1, 16, src_rank=src_rank, dst_rank=dst_rank)
    return batch.src, batch.dsts[0], Policy.STRICT


# -- the receiver's side, with an in-memory engine and channel ------------------------------------
PAGE, PAGE_BYTES = 4, 256


def _decode_endpoint(sender: str = "same"):
    """A decode side whose request r1 (row 1, 16 tokens) has pages 3, 4, 5 and 9: runs (3, 3) and (9, 1).
    ``sender``: the layout its sender pairs with ("same" as the decode's, "pages of 8", or "unpaired")."""
    pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    side = SideMemory(KVLayout(Attention.MLA, PAGE, (Entry(pool.data_ptr(), PAGE_BYTES, 16),)),
                      req_to_token=table_with({1: [3, 4, 5, 9]}, PAGE, max_ctx=16))
    staging = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
    mine, theirs = FakeChannel.pair()
    endpoint = DecodeEndpoint(side, FakeEngine(), mine, staging)
    if sender != "unpaired":
        src = side if sender == "same" else SideMemory(
            KVLayout(Attention.MLA, 2 * PAGE, (Entry(1 << 20, 2 * PAGE_BYTES, 8),)),
            req_to_token=table_with({1: [1, 2]}, 2 * PAGE, max_ctx=16))
        theirs.send("paired", {"from": "p0", "side": describe_side(src)})
    endpoint.publish([PreallocatedRequest("r1", row=1, prompt_len=16)], timeout=30)
    kind, header, _ = theirs.try_recv()
    assert kind == "request" and header["plans"] is True
    return endpoint, theirs, pool, staging


@pytest.fixture
def decode():
    return _decode_endpoint()


FORMS = ["whole", "chunks first"]  # one announcement, or the chunks as soon as planned, then the waves


def _announce(channel, waves, transfers=(("r1", 0, 17, True),), alignment=16, form="whole", run=3):
    chunks = {"from": "p0", "alignment": alignment, "transfers": [list(t) for t in transfers]}
    if form == "whole":
        channel.send("staged-plan", {**chunks, "waves": [list(w) for w in waves]})
    else:
        channel.send("staged-plan", {**chunks, "run": run})
        channel.send("staged-waves", {"from": "p0", "run": run, "waves": [list(w) for w in waves]})


@pytest.mark.parametrize("form", FORMS)
def test_a_planned_run_is_scattered_wave_by_wave(decode, form):
    endpoint, prefill, pool, staging = decode
    # two waves: bytes [0, 640) in slot 0 and [640, 1024) at 2048; the cut falls inside the run of pages 3-5
    _announce(prefill, [(7, 0, 0, 640), (8, 2048, 640, 1024)], form=form)
    endpoint.engine.inbox += [wave_note(7, "p0"), wave_note(8, "p0")]
    deadline = time.monotonic() + 60
    while endpoint.tracker.state("r1") == "pending" and time.monotonic() < deadline:
        endpoint.poll()
    credits = [prefill.try_recv() for _ in range(2)]
    assert [(k, h) for k, h, _ in credits] == [("wave-done", {"wave": 7}), ("wave-done", {"wave": 8})]
    assert endpoint.wait() == {"r1": "complete"}
    stream = torch.cat([staging[0:640], staging[2048 : 2048 + 384]])
    page = lambda p: pool[p * PAGE_BYTES : (p + 1) * PAGE_BYTES]  # noqa: E731
    assert torch.equal(torch.cat([page(3), page(4), page(5), page(9)]), stream)
    untouched = [p for p in range(16) if p not in (3, 4, 5, 9)]
    assert all(int(page(p).sum()) == 0 for p in untouched)


@pytest.mark.parametrize("transfers, waves, why", [
    ((("r1", 2, 17, True),), [(7, 0, 0, 1024)], "do not plan against what this side published"),  # unaligned
    ((("r1", 0, 17, True),), [(7, 0, 0, 768)], "this side's plan of its chunks has 1024"),  # a short run
    ((("r1", 0, 17, True),), [(7, 0, 0, 1280)], "this side's plan of its chunks has 1024"),  # a long one
    ((("r1", 0, 17, True), ("r2", 0, 17, True)), [(7, 0, 0, 2048)], "has not published"),
    ((("r1", 0, 17, True),), [(7, 0, 0, 512), (8, 1024, 600, 1024)], "do not follow"),
    ((("r1", 0, 17, True),), [(7, 4096 - 512, 0, 1024)], "staging buffer holds"),
])
@pytest.mark.parametrize("form", FORMS)
def test_a_planned_run_that_disagrees_with_what_was_published_is_refused(decode, transfers, waves, why, form):
    endpoint, prefill, pool, _ = decode
    _announce(prefill, waves, transfers, form=form)
    endpoint.engine.inbox += [wave_note(w[0], "p0") for w in waves]
    states = endpoint.wait()
    assert states == {"r1": "failed"} and "refused staged run" in endpoint.failures["r1"]
    kind, header, _ = prefill.try_recv()
    assert kind == "wave-done" and why in header["error"]
    assert int(pool.sum()) == 0, "bytes were written by a refused run"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("sender", ["pages of 8", "unpaired"])
def test_a_planned_run_from_a_sender_this_side_cannot_plan_for_is_refused(sender, form):
    """Whether a run may come without tables is this side's call, from the layout its sender paired with:
    a sender of other page sizes (or one that never paired) cannot make it plan whole items."""
    endpoint, prefill, pool, _ = _decode_endpoint(sender)
    _announce(prefill, [(7, 0, 0, 1024)], form=form)
    endpoint.engine.inbox.append(wave_note(7, "p0"))
    assert endpoint.wait() == {"r1": "failed"} and "cannot plan a scatter for" in endpoint.failures["r1"]
    assert int(pool.sum()) == 0, "bytes were written by a refused run"


def test_a_request_published_without_a_row_cannot_be_planned(decode):
    """Lists tracked from elsewhere (an adapter's) have no row here: such a run needs its table."""
    endpoint, prefill, pool, _ = decode
    side = endpoint.side
    published = plan_destinations(replace(side), [PreallocatedRequest("t1", row=1, prompt_len=16)]).result()
    endpoint.track([replace(published[0], request="t1")], time.monotonic() + 30)
    _announce(prefill, [(7, 0, 0, 1024)], (("t1", 0, 17, True),))
    endpoint.engine.inbox.append(wave_note(7, "p0"))
    deadline = time.monotonic() + 30
    while endpoint.tracker.state("t1") == "pending" and time.monotonic() < deadline:
        endpoint.poll()
    assert "not published with a row" in endpoint.tracker.failure("t1") and int(pool.sum()) == 0


@pytest.mark.parametrize("form", FORMS)
def test_an_announced_alignment_above_the_sides_own_is_not_used(decode, form):
    """A peer's claim never widens the copy word past what this side's own addresses allow."""
    endpoint, prefill, pool, staging = decode
    _announce(prefill, [(7, 0, 0, 1024)], alignment=1 << 20, form=form)
    endpoint.poll()
    own = plan_alignment(Batch(endpoint.side, (endpoint.side,), ()))
    assert own <= PAGE_BYTES and endpoint._waves["p0:7"].alignment == own
    endpoint.engine.inbox.append(wave_note(7, "p0"))
    assert endpoint.wait() == {"r1": "complete"}



def test_waves_of_a_run_never_announced_are_refused(decode):
    """A ``staged-waves`` message must name a run whose chunks this side planned: else nothing is written."""
    endpoint, prefill, pool, _ = decode
    prefill.send("staged-waves", {"from": "p0", "run": 9, "waves": [[7, 0, 0, 1024]]})
    endpoint.engine.inbox.append(wave_note(7, "p0"))
    for _ in range(20):
        endpoint.poll()
    kind, header, _ = prefill.try_recv()
    assert kind == "wave-done" and "not announced" in header["error"]
    assert int(pool.sum()) == 0 and endpoint.tracker.state("r1") == "pending"


def test_a_withdrawn_run_writes_nothing_and_the_request_can_still_be_sent(decode):
    """The sender announced a run's chunks, then sent the batch otherwise (``cancel``): the run is
    dropped, and the request completes from the next announcement."""
    endpoint, prefill, pool, staging = decode
    prefill.send("staged-plan", {"from": "p0", "alignment": 16, "transfers": [["r1", 0, 17, True]], "run": 4})
    prefill.send("staged-waves", {"from": "p0", "run": 4, "cancel": "sent direct"})
    for _ in range(20):
        endpoint.poll()
    assert not endpoint._chunked and not endpoint._waves and int(pool.sum()) == 0
    _announce(prefill, [(7, 0, 0, 1024)], form="chunks first", run=5)
    endpoint.engine.inbox.append(wave_note(7, "p0"))
    assert endpoint.wait() == {"r1": "complete"}


def test_waves_of_a_run_whose_chunks_were_refused_are_refused(decode):
    endpoint, prefill, pool, _ = decode
    _announce(prefill, [(7, 0, 0, 1024)], (("r1", 2, 17, True),), form="chunks first")  # unaligned chunk
    endpoint.engine.inbox.append(wave_note(7, "p0"))
    assert endpoint.wait() == {"r1": "failed"}
    for _ in range(5):
        endpoint.poll()
    kind, header, _ = prefill.try_recv()
    assert kind == "wave-done" and header["wave"] == 7 and "do not plan against" in header["error"]
    assert int(pool.sum()) == 0
