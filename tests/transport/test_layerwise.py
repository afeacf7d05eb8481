"""The sender's side of streaming in layer groups (docs/layerwise.md), with an in-memory engine and
channel: nothing of a group is posted before the forward pass has marked it, and a group that is
never marked fails its requests at the deadline with nothing of it or later groups posted."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvplan.planner.device.destinations import PreallocatedRequest, plan_destinations
from kvplan.planner.contract.layer_groups import LayerGroups
from kvplan.planner.contract.batch import Attention, Entry, KVLayout, SideMemory, StateComponent, StateKind
from kvplan.transport.completion import CompletionTracker, decode_notification
from kvplan.transport.prefill import Chunk, PrefillEndpoint
from kvplan.transport.readiness import LayerReadiness, LayerStreaming
from kvplan.transport.registration import describe_side
from tests.planner.builders import table_with
from tests.transport.fakes import FakeChannel, FakeDeviceEngine, FakeEngine

PAGE, PAGE_BYTES, LAYERS = 4, 256, 4


def side(pools, rows):
    kv = tuple(Entry(p.data_ptr(), PAGE_BYTES, 16) for p in pools[:2 * LAYERS])
    dsa = StateComponent(StateKind.DSA, tuple(Entry(p.data_ptr(), 64, 16) for p in pools[2 * LAYERS:]),
                         layers=(1, 3))
    aux = (Entry(pools[0].data_ptr(), 16, 16),)
    return SideMemory(KVLayout(Attention.MHA, PAGE, kv), (dsa,), aux, table_with(rows, PAGE, max_ctx=16))


def pools():
    return [torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8) for _ in range(2 * LAYERS + 2)]


class ForwardPass:
    """Readiness that a stand-in forward pass advances by one group every ``every`` looks."""

    def __init__(self, groups: int, every: int = 3, stop_at: int | None = None):
        self.signal = LayerReadiness(groups, device="cpu")
        self.looks, self.every, self.stop_at = 0, every, stop_at

    def ready(self) -> int:
        self.looks += 1
        done = self.signal.ready()
        if self.looks % self.every == 0 and done < self.signal.groups and done != self.stop_at:
            self.signal.mark(done)
        return self.signal.ready()


def _pair(staging_bytes: int = 0, engine=None):
    decode_pools, prefill_pools = pools(), pools()
    decode_side = side(decode_pools, {1: [3, 4], 2: [6, 7]})
    mine, theirs = FakeChannel.pair()
    engine = engine or FakeEngine()
    staging = [torch.zeros(staging_bytes, dtype=torch.uint8) for _ in range(2)] if staging_bytes else None
    prefill = PrefillEndpoint(side(prefill_pools, {1: [5, 9], 2: [10, 11]}), engine, mine,
                              staging[0] if staging else None)
    prefill._kept_alive = (decode_pools, prefill_pools, staging)
    theirs.send("register", {"side": describe_side(decode_side),
                             "staging": [staging[1].data_ptr(), staging_bytes] if staging else None}, b"meta")
    prefill.accept(timeout=1)
    requests = [PreallocatedRequest("r1", 1, 8, aux_index=1), PreallocatedRequest("r2", 2, 8, aux_index=2)]
    pending = plan_destinations(decode_side, requests)
    for r, message in zip(requests, pending.messages()):
        theirs.send("request", {"request": r.request, "prompt_len": 8, "prefix_len": 0}, message)
    prefill.receive_requests(2, timeout=1)
    chunks = [prefill.transfer(Chunk(r.request, r.row, 0, 9, 8, True, r.row)) for r in requests]
    return prefill, engine, theirs, chunks, decode_side, pending.result()


def test_each_group_is_posted_only_after_the_forward_pass_marked_it_and_the_receiver_completes():
    prefill, engine, decode, chunks, decode_side, published = _pair()
    groups = LayerGroups((0, 1, 3, 4))
    forward = ForwardPass(groups.count)
    marked_when_posted = []
    engine.on_post = lambda descs, note: marked_when_posted.append((forward.signal.ready(), json.loads(note)))
    result = prefill.send(chunks, mode="auto", timeout=5, layers=LayerStreaming(groups, forward))
    assert result == {"r1": None, "r2": None} and prefill.last_mode == "direct"
    for ready, note in marked_when_posted:
        lo, hi = note[4:6] if len(note) == 6 else (groups.bounds[-2], groups.bounds[-1])  # aux: the last group
        assert hi <= groups.bounds[ready], f"{note} posted when only {ready} groups were written"
    assert {ready for ready, _ in marked_when_posted} == {1, 2, 3}  # one posting round per group
    _assert_complete_and_the_plan_once(prefill, engine, chunks, decode_side, published,
                                       [d for d, _ in engine.posted])


def _assert_complete_and_the_plan_once(prefill, engine, chunks, decode_side, published, written) -> None:
    """The engine's notes complete every request at the receiver, and ``written`` (descriptor arrays) is
    the batch's plan, each descriptor once."""
    tracker = CompletionTracker(decode_side)
    for p in published:
        tracker.expect(p.expectation(), 1e18)
    for _, note in engine.posted:
        tracker.on_section(decode_notification(note))
    assert tracker.states() == {"r1": "complete", "r2": "complete"}
    planned = prefill._planner(False).plan(prefill_batch(prefill, chunks)).descriptors()[0]
    assert sorted(map(tuple, np.concatenate(written).tolist())) == sorted(map(tuple, planned.tolist()))


def test_an_engine_that_writes_from_device_descriptors_gets_one_launch_per_group_after_its_mark():
    """With an engine like ``ipc``, a group's sections go as one launch over their rows gathered on the
    device, never before the group is marked (on a GPU, queued behind the mark's event instead), and
    the launches together are the plan, once."""
    prefill, engine, decode, chunks, decode_side, published = _pair(engine=FakeDeviceEngine())
    groups = LayerGroups((0, 1, 3, 4))
    forward = ForwardPass(groups.count)
    marked = []
    engine.on_post = lambda descs, note: marked.append((len(engine.launches), forward.signal.ready()))
    result = prefill.send(chunks, mode="auto", timeout=5, layers=LayerStreaming(groups, forward))
    assert result == {"r1": None, "r2": None} and prefill.last_mode == "direct"
    assert len(engine.launches) == groups.count  # one per group (one decode endpoint)
    assert all(ready >= launch for launch, ready in marked), marked  # launch k after group k-1 was marked
    _assert_complete_and_the_plan_once(prefill, engine, chunks, decode_side, published,
                                       [rows for rows, _ in engine.launches])


def prefill_batch(prefill, chunks):
    from kvplan.planner.contract.batch import Batch

    return Batch(prefill.side, (prefill.peer_side,), tuple(chunks))


def test_a_staged_stream_announces_the_next_group_before_this_group_moves():
    """The receiver checks the next group's tables while this group's bytes move (docs/layerwise.md §3):
    when a wave of group g is posted, the runs of groups 0..g+1 have been announced."""
    prefill, engine, decode, chunks, _, _ = _pair(staging_bytes=8192)
    groups = LayerGroups((0, 1, 3, 4))
    runs, posted = [], []  # each announced run's wave ids, in order; (group, runs announced) at each post

    def on_post(descs, note):
        while (msg := decode.try_recv()) is not None:
            if msg[0] == "staged":
                runs.append({w[0] for w in msg[1]["waves"]})
        wave = json.loads(note)["wave"]
        posted.append((next(g for g, ids in enumerate(runs) if wave in ids), len(runs)))
        decode.send("wave-done", {"wave": wave})  # the receiver's credit

    engine.on_post = on_post
    result = prefill.send(chunks, mode="staged", timeout=30, layers=LayerStreaming(groups, ForwardPass(groups.count)))
    assert result == {"r1": None, "r2": None} and prefill.last_mode == "staged"
    assert len(runs) == groups.count and {g for g, _ in posted} == set(range(groups.count))
    assert all(announced >= min(g + 2, groups.count) for g, announced in posted), posted


def test_a_group_never_written_fails_every_request_at_the_deadline_and_nothing_later_is_posted():
    prefill, engine, decode, chunks, _, _ = _pair()
    groups = LayerGroups((0, 2, 4))
    result = prefill.send(chunks, mode="direct", timeout=0.3, layers=LayerStreaming(groups, ForwardPass(2, stop_at=1)))
    assert set(result) == {"r1", "r2"}
    assert all(r and "layer group 1 was not written" in r for r in result.values()), result
    layers = [json.loads(note)[4:6] for _, note in engine.posted]
    assert layers and all(len(x) == 2 and x[1] <= 2 for x in layers), layers  # group 0 only; no aux
    failed = set()
    while (msg := decode.try_recv()) is not None:
        if msg[0] == "failed":
            failed.add(msg[1]["request"])
    assert failed == {"r1", "r2"}


def test_streaming_refuses_prepared_lists_and_mismatched_signals():
    prefill, _, _, chunks, _, _ = _pair()
    groups = LayerGroups((0, 2, 4))
    with pytest.raises(ValueError, match="cannot stream"):
        prefill.send(chunks, mode="prepared", layers=LayerStreaming(groups, ForwardPass(2)))
    with pytest.raises(Exception, match="counts 3 groups"):
        LayerStreaming(groups, LayerReadiness(3, device="cpu"))


def test_the_readiness_word_counts_marks_and_resets():
    signal = LayerReadiness(3, device="cpu")
    assert signal.ready() == 0
    signal.mark(0)
    signal.mark(2)
    assert signal.ready() == 3
    signal.reset()
    assert signal.ready() == 0
    with pytest.raises(Exception, match="outside"):
        signal.mark(3)
    assert signal.written(0) is None  # no event on the CPU: a sender gathers once it reads the word


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events")
def test_a_groups_event_is_offered_only_once_this_pass_has_queued_its_mark():
    """A sender gathers ahead behind :meth:`LayerReadiness.written`; an event of an earlier pass (or of
    a mark not queued yet) would let it gather bytes the forward pass has not written."""
    signal = LayerReadiness(2, device="cuda")
    assert signal.written(0) is None
    torch.cuda._sleep(50_000_000)  # the mark waits behind the pass's kernels
    signal.mark(0)
    event = signal.written(0)
    assert event is not None and signal.written(1) is None
    assert not event.query() and signal.ready() == 0  # recorded behind the sleep, like the word
    event.synchronize()
    assert signal.ready() == 1
    signal.reset()
    assert signal.written(0) is None  # the next pass has not marked yet
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            signal.mark(1)  # captured: no event stands for a replay
    assert signal.written(1) is None
    graph.replay()
    torch.cuda.synchronize()
    assert signal.ready() == 2


def test_a_decode_that_dies_mid_stream_fails_every_request_and_nothing_later_is_posted():
    prefill, engine, decode, chunks, _, _ = _pair()
    gone = []
    prefill.peers[0].channel.peer_gone = lambda: bool(gone)
    engine.on_post = lambda descs, note: gone.append(True)  # dies as the first group's writes go out
    groups = LayerGroups((0, 2, 4))
    result = prefill.send(chunks, mode="direct", timeout=5, layers=LayerStreaming(groups, ForwardPass(2)))
    assert all(r and "decode side is gone" in r for r in result.values()), result
    assert all(json.loads(note)[5] <= 2 for _, note in engine.posted)  # group 0 only
