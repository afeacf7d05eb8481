"""One decode rank gathering a request from several source ranks (TP gather, docs/tp_state.md §4),
with an in-memory engine and channels:

* the tracker counts each sender's part against its own expectation: one sender's whole part is
  not the request, a sender it was not published to fails it, and so does a part sent twice;
* a sender whose pairing slices nothing of a component is not waited for on it;
* a gather is refused unless its senders are exactly the source ranks holding this rank's part;
* notifications name their sender where the receiver has several;
* a failure reported by either sender, or the loss of either, fails the request.
"""

import time
from dataclasses import replace

import numpy as np
import pytest

from kvplan.errors import LayoutError
from kvplan.planner.device.destinations import Expectation, PreallocatedRequest
from kvplan.planner.contract.plan import AUX_ROLE, KV_ROLE, Section
from kvplan.tools.scenarios import build_batch
from kvplan.transport.completion import CompletionTracker, SectionNote, decode_notification, encode_notification
from kvplan.transport.decode import DecodeEndpoint
from kvplan.transport.registration import describe_side
from tests.transport.fakes import FakeChannel, FakeEngine
from tests.transport.handoff import MAMBA_TP8TO4

PAGES = 3
EXPECTED = Expectation("r", PAGES, True, ("mamba", "conv"))


def part(sender, tracker, components=("mamba", "conv"), request="r"):
    tracker.on_section(SectionNote(request, KV_ROLE, "kv", PAGES, sender=sender))
    for c, name in enumerate(components):
        tracker.on_section(SectionNote(request, c, name, 1, sender=sender))
    tracker.on_section(SectionNote(request, AUX_ROLE, "aux", 1, sender=sender))


def gathered(senders={0: None, 1: None}):
    tracker = CompletionTracker()
    tracker.expect(EXPECTED, time.monotonic() + 30, senders=senders)
    return tracker


def test_a_gathered_request_completes_only_when_every_sender_has_landed_its_part():
    tracker = gathered()
    part(0, tracker)
    assert tracker.state("r") == "pending"  # one source rank's heads are half of every page
    part(1, tracker)
    assert tracker.state("r") == "complete"


def test_a_section_from_a_sender_the_request_was_not_published_to_fails_it():
    tracker = gathered()
    part(0, tracker)
    tracker.on_section(SectionNote("r", KV_ROLE, "kv", PAGES, sender=2))
    assert tracker.state("r") == "failed" and "sender 2" in tracker.failure("r")
    unnamed = gathered()
    unnamed.on_section(SectionNote("r", KV_ROLE, "kv", PAGES))  # a note that names no sender
    assert unnamed.state("r") == "failed"


def test_one_sender_landing_its_part_twice_does_not_stand_in_for_the_other():
    tracker = gathered()
    part(0, tracker)
    tracker.on_section(SectionNote("r", KV_ROLE, "kv", PAGES, sender=0))
    assert tracker.state("r") == "failed" and "KV pages" in tracker.failure("r")


def test_a_sender_that_slices_nothing_of_a_component_is_not_waited_for_on_it():
    tracker = gathered({0: frozenset({"mamba", "conv"}), 1: frozenset({"mamba"})})
    part(0, tracker)
    part(1, tracker, components=("mamba",))
    assert tracker.state("r") == "complete"
    strict = gathered({0: frozenset({"mamba", "conv"}), 1: frozenset({"mamba"})})
    part(1, strict)  # ... and a section of it from that sender is one it was never to send
    assert strict.state("r") == "failed" and "'conv'" in strict.failure("r")


def test_a_single_sender_request_takes_notes_from_whichever_channel_writes_it():
    tracker = CompletionTracker()
    tracker.expect(EXPECTED, time.monotonic() + 30)
    part(None, tracker, components=("mamba",))
    tracker.on_section(SectionNote("r", 1, "conv", 1, sender=3))
    assert tracker.state("r") == "complete"


def test_a_notification_names_its_sender_only_where_the_receiver_has_several():
    section = Section(0, "r", KV_ROLE, "kv", 0, 4, PAGES, (2, 5))
    assert decode_notification(encode_notification(section)) == SectionNote("r", KV_ROLE, "kv", PAGES, (2, 5))
    assert decode_notification(encode_notification(section, sender=1)).sender == 1
    assert encode_notification(section) == b'["r", -1, "kv", 3, 2, 5]'


# -- the decode endpoint ----------------------------------------------------------------------------
def sides(src_ranks, dst_rank=0):
    batches = [build_batch(MAMBA_TP8TO4, 1, 40, seed=3, src_rank=r, dst_rank=dst_rank) for r in src_ranks]
    return [b.src for b in batches], batches[0].dsts[0]


def decode_with(src_ranks, dst_rank=0):
    srcs, dst = sides(src_ranks, dst_rank)
    pairs = [FakeChannel.pair() for _ in srcs]
    endpoint = DecodeEndpoint(dst, FakeEngine(), [mine for mine, _ in pairs])
    endpoint.register()
    for src, (_, theirs) in zip(srcs, pairs):
        theirs.send("paired", {"from": "p", "side": describe_side(src)})
    return endpoint, [theirs for _, theirs in pairs]


def test_each_sender_learns_its_index_and_a_gather_is_published_to_both():
    endpoint, prefills = decode_with([0, 1])
    assert [p.try_recv()[1]["peer"] for p in prefills] == [0, 1]
    endpoint.publish([PreallocatedRequest("r1", row=1, prompt_len=40)], timeout=5, peer=[0, 1])
    assert [p.try_recv()[0:2][0] for p in prefills] == ["request", "request"]
    assert endpoint.tracker.state("r1") == "pending"
    # rank 1 of the group writes no replicated-only component: it is not waited for on it
    assert {k: sorted(p.components) for k, p in endpoint.tracker._status["r1"].parts.items()} == \
        {0: ["mamba", "mamba-replicated"], 1: ["mamba"]}


@pytest.mark.parametrize("src_ranks, dst_rank, why", [
    ([1, 2], 0, "gathers from ranks [0, 1] of TP 8"),  # a rank of another group, one missing
    ([0, 0], 0, "distinct"),
    ([2, 3], 0, "gathers from ranks [0, 1]"),
])
def test_a_gather_from_the_wrong_source_ranks_is_refused(src_ranks, dst_rank, why):
    if len(set(src_ranks)) != len(src_ranks):
        endpoint, _ = decode_with([0, 1], dst_rank)
        with pytest.raises(ValueError, match=why):
            endpoint.publish([PreallocatedRequest("r1", row=1, prompt_len=40)], timeout=5, peer=[0, 0])
        return
    endpoint, prefills = decode_with(src_ranks, dst_rank)
    with pytest.raises(LayoutError, match=why.replace("[", r"\[").replace("]", r"\]")):
        endpoint.publish([PreallocatedRequest("r1", row=1, prompt_len=40)], timeout=5, peer=[0, 1])
    assert "r1" not in endpoint.tracker and all(p.inbox.__len__() == 0 or p.try_recv()[0] == "register"
                                               for p in prefills)


def test_a_gather_waits_for_its_senders_layouts_then_gives_up():
    srcs, dst = sides([0, 1])
    pairs = [FakeChannel.pair() for _ in srcs]
    endpoint = DecodeEndpoint(dst, FakeEngine(), [mine for mine, _ in pairs])
    pairs[0][1].send("paired", {"from": "p", "side": describe_side(srcs[0])})  # the second never pairs
    from kvplan.transport.control import ControlTimeout

    t0 = time.monotonic()
    with pytest.raises(ControlTimeout, match=r"senders \[1\]"):
        endpoint.publish([PreallocatedRequest("r1", row=1, prompt_len=40)], timeout=0.2, peer=[0, 1])
    assert time.monotonic() - t0 < 5


def test_a_gather_into_a_rank_of_the_same_tp_size_is_refused():
    batch = build_batch(MAMBA_TP8TO4, 1, 40, seed=3)
    srcs = [replace(batch.src, kv=replace(batch.src.kv, tp_size=4, tp_rank=r)) for r in (0, 1)]
    dst = batch.dsts[0]
    pairs = [FakeChannel.pair() for _ in srcs]
    endpoint = DecodeEndpoint(dst, FakeEngine(), [mine for mine, _ in pairs])
    for src, (_, theirs) in zip(srcs, pairs):
        theirs.send("paired", {"from": "p", "side": describe_side(src)})
    with pytest.raises(LayoutError, match="larger TP size"):
        endpoint.publish([PreallocatedRequest("r1", row=1, prompt_len=40)], timeout=5, peer=[0, 1])
    assert np.all([r not in endpoint.tracker for r in ("r1",)])


@pytest.mark.parametrize("which", [0, 1])
def test_a_failure_reported_by_either_sender_fails_the_gathered_request(which):
    endpoint, prefills = decode_with([0, 1])
    endpoint.publish([PreallocatedRequest("r1", row=1, prompt_len=40)], timeout=5, peer=[0, 1])
    prefills[which].send("failed", {"request": "r1", "reason": "the forward pass crashed"})
    endpoint.poll()
    assert endpoint.tracker.state("r1") == "failed" and "crashed" in endpoint.tracker.failure("r1")


@pytest.mark.parametrize("which", [0, 1])
def test_losing_either_sender_fails_the_gathered_request(which, monkeypatch):
    endpoint, _ = decode_with([0, 1])
    endpoint.publish([PreallocatedRequest("r1", row=1, prompt_len=40)], timeout=5, peer=[0, 1])
    monkeypatch.setattr(endpoint.channels[which], "peer_gone", lambda: True)
    deadline = time.monotonic() + 5  # (a loss fails its requests after the decode's GONE_GRACE_S)
    while endpoint.tracker.state("r1") == "pending" and time.monotonic() < deadline:
        endpoint.poll()
        time.sleep(0.01)
    assert endpoint.tracker.state("r1") == "failed" and "gone" in endpoint.tracker.failure("r1")
