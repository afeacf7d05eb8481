"""The sender's side of staged mode with an in-memory engine and channel: messages that are not
credits (the next requests' lists) survive a staged send and reach receive_requests; a run the
receiver plans goes as its chunks, then its waves, and chunks of a batch not sent staged are withdrawn."""

import json

import pytest
import torch

from kvplan.errors import AllocatorInvariantError
from kvplan.planner.device.destinations import PreallocatedRequest, plan_destinations
from kvplan.planner.device.pending import PendingPlan
from kvplan.planner.contract.batch import Attention, Entry, KVLayout, SideMemory
from kvplan.transport.control import ControlTimeout
from kvplan.transport.prefill import Chunk, PrefillEndpoint
from kvplan.transport.registration import describe_side
from kvplan.transport.waves import credit_note
from tests.planner.builders import table_with
from tests.transport.fakes import FakeChannel, FakeEngine, NotifyingFakeEngine

PAGE, PAGE_BYTES = 4, 256


def side(pool, rows):
    return SideMemory(KVLayout(Attention.MLA, PAGE, (Entry(pool.data_ptr(), PAGE_BYTES, 16),)),
                      req_to_token=table_with(rows, PAGE, max_ctx=16))


def _staged_pair(plans: bool = False, staging_bytes: int = 4096, engine=None, notifies: bool = False):
    """A prefill endpoint paired with a fake decode side that has staging, r1's lists received (with
    ``plans``: published with a row, so the decode plans r1's staged runs itself); the pools and
    staging buffers are returned to keep them alive. The source pool's byte ``i`` holds ``i % 251``."""
    src_pool = (torch.arange(16 * PAGE_BYTES) % 251).to(torch.uint8)
    dst_pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    decode_side = side(dst_pool, {1: [3, 4], 2: [6, 7]})
    mine, theirs = FakeChannel.pair()
    engine = engine or FakeEngine()
    staging = torch.zeros(staging_bytes, dtype=torch.uint8)
    peer_staging = torch.zeros(staging_bytes, dtype=torch.uint8)
    prefill = PrefillEndpoint(side(src_pool, {1: [5, 9]}), engine, mine, staging)
    theirs.send("register", {"side": describe_side(decode_side), "staging": [peer_staging.data_ptr(), staging_bytes],
                             "notifies": notifies}, b"meta")
    prefill.accept(timeout=1)
    messages = plan_destinations(decode_side, [PreallocatedRequest("r1", 1, 8), PreallocatedRequest("r2", 2, 8)]).messages()
    theirs.send("request", {"request": "r1", "prompt_len": 8, "prefix_len": 0, "plans": plans}, messages[0])
    prefill.receive_requests(1, timeout=1)
    return prefill, engine, mine, theirs, messages, (src_pool, dst_pool, staging, peer_staging)


def _sent(channel):
    """What the sender sent about runs and requests (not its pairing or heartbeats), in order."""
    out = []
    while (msg := channel.try_recv()) is not None:
        if msg[0] not in ("paired", "heartbeat"):
            out.append((msg[0], msg[1]))
    return out


def test_a_run_the_receiver_plans_goes_as_its_chunks_then_its_waves():
    """The chunks leave as soon as the plan is launched; the waves name the same run once it is seen."""
    prefill, engine, _, theirs, _, _buffers = _staged_pair(plans=True)
    engine.on_post = lambda descs, note: theirs.send("wave-done", {"wave": json.loads(note)["wave"]})
    assert prefill.send([prefill.transfer(Chunk("r1", 1, 0, 9, 8, True))], mode="staged", timeout=5) == {"r1": None}
    (kind1, chunks), (kind2, waves) = _sent(theirs)
    assert kind1 == "staged-plan" and "waves" not in chunks and chunks["transfers"] == [["r1", 0, 9, True]]
    assert kind2 == "staged-waves" and waves["run"] == chunks["run"] and len(waves["waves"]) == 1
    assert prefill.last_announcement == "planned"


@pytest.mark.parametrize("staging_bytes, waves", [(4096, 1), (1024, 2)])
def test_a_planned_run_copies_its_descriptors_to_the_host_only_when_it_has_several_waves(monkeypatch, staging_bytes,
                                                                                         waves):
    """r1's 2 pages (512 bytes) fit one slot of a 4096-byte ring of 4: the run goes from the plan's
    counts alone, its descriptors never copied to the host nor its sections read (the receiver
    counts its own). In 256-byte slots it takes two waves, cut
    at descriptors: then they are copied. Either way the slots hold pages 5 and 9, and the waves say
    which bytes of the run each holds."""
    prefill, engine, _, theirs, _, buffers = _staged_pair(plans=True, staging_bytes=staging_bytes)
    copied, read = [], []
    real, real_sections = PendingPlan.descriptors, PendingPlan.sections
    monkeypatch.setattr(PendingPlan, "descriptors", lambda plan: copied.append(1) or real(plan))
    monkeypatch.setattr(PendingPlan, "sections", lambda plan: read.append(1) or real_sections(plan))
    engine.on_post = lambda descs, note: theirs.send("wave-done", {"wave": json.loads(note)["wave"]})
    assert prefill.send([prefill.transfer(Chunk("r1", 1, 0, 8, 8, True))], mode="staged", timeout=5) == {"r1": None}
    assert bool(copied) == bool(read) == (waves > 1)
    src_pool, staging = buffers[0], buffers[2]
    pages = torch.cat([src_pool[p * PAGE_BYTES : (p + 1) * PAGE_BYTES] for p in (5, 9)])
    slots = [(int(d[0, 0]) - staging.data_ptr(), int(d[0, 2])) for d, _ in engine.posted]
    assert len(slots) == waves and sum(n for _, n in slots) == 2 * PAGE_BYTES
    assert torch.equal(torch.cat([staging[lo : lo + n] for lo, n in slots]), pages)  # (each wave its own slot)
    (_, _), (_, announced) = _sent(theirs)
    assert [w[2:] for w in announced["waves"]] == ([[0, 512]] if waves == 1 else [[0, 256], [256, 512]])


@pytest.mark.parametrize("notifies", [True, False])
def test_credits_come_back_through_the_engine_where_both_sides_can(notifies):
    """A receiver whose engine notifies is sent this side's engine metadata with the pairing and
    returns its credits as engine notifications, which end the run; else they come on the channel."""
    engine = NotifyingFakeEngine()
    prefill, _, _, theirs, _, _buffers = _staged_pair(plans=True, engine=engine, notifies=notifies)
    kind, paired, frames = theirs.try_recv()
    assert kind == "paired" and (paired.get("credits") == "engine") == notifies and (frames == [b"fake"]) == notifies
    if notifies:
        engine.on_post = lambda descs, note: engine.inbox.append(credit_note(json.loads(note)["wave"]))
    else:
        engine.on_post = lambda descs, note: theirs.send("wave-done", {"wave": json.loads(note)["wave"]})
    assert prefill.send([prefill.transfer(Chunk("r1", 1, 0, 8, 8, True))], mode="staged", timeout=5) == {"r1": None}


def test_a_staged_run_asks_the_engine_for_credits_only_while_one_is_due():
    """Polling the engine's notifications contends with its progress thread, which slows the next
    post (benchmarks/post_cost.py): a run looks for credits only once it has a write uncredited."""

    class CountingEngine(NotifyingFakeEngine):
        def __init__(self):
            super().__init__()
            self.looked_with: list[tuple[int, int]] = []  # (writes posted, credits queued) at each look

        def notifications(self):
            self.looked_with.append((len(self.posted), len(self.inbox)))
            return super().notifications()

    engine = CountingEngine()
    prefill, _, _, theirs, _, _buffers = _staged_pair(plans=True, engine=engine, notifies=True,
                                                      staging_bytes=1024)  # two waves: a slot of 512 B each
    engine.on_post = lambda descs, note: engine.inbox.append(credit_note(json.loads(note)["wave"]))
    assert prefill.send([prefill.transfer(Chunk("r1", 1, 0, 8, 8, True))], mode="staged", timeout=5) == {"r1": None}
    assert len(engine.posted) >= 2 and engine.looked_with
    assert all(posted >= 1 for posted, _ in engine.looked_with), engine.looked_with


def test_a_batch_refused_after_its_chunks_went_withdraws_them():
    """r1's chunk reaches past its source row's pages: the sender's plan refuses the batch after the
    chunks were announced, so they are withdrawn before the failure is reported, and nothing is written."""
    prefill, engine, _, theirs, _, _buffers = _staged_pair(plans=True)
    with pytest.raises(AllocatorInvariantError):
        prefill.send([prefill.transfer(Chunk("r1", 2, 0, 9, 8, True))], mode="staged", timeout=5)
    sent = _sent(theirs)
    assert [kind for kind, _ in sent] == ["staged-plan", "staged-waves", "failed"], sent
    assert sent[1][1]["run"] == sent[0][1]["run"] and "batch refused" in sent[1][1]["cancel"]
    assert not engine.posted


def test_lists_that_arrive_during_a_staged_send_are_kept_for_receive_requests():
    prefill, engine, mine, theirs, messages, _buffers = _staged_pair()

    def decode_answers(descs, note):  # a fast receiver: the credit, then at once the next request's lists
        theirs.send("wave-done", {"wave": json.loads(note)["wave"]})
        theirs.send("request", {"request": "r2", "prompt_len": 8, "prefix_len": 0}, messages[1])

    engine.on_post = decode_answers
    result = prefill.send([prefill.transfer(Chunk("r1", 1, 0, 9, 8, True))], mode="staged", timeout=5)
    assert result == {"r1": None}
    try:
        prefill.receive_requests(1, timeout=0)
    except ControlTimeout:
        raise AssertionError("the next request's lists were consumed by the staged send") from None
    assert "r2" in prefill.lists


def _direct_pair(refuse):
    src_pool, dst_pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8), torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    decode_side = side(dst_pool, {1: [3, 4], 2: [6, 7]})
    mine, theirs = FakeChannel.pair()
    engine = FakeEngine()
    prefill = PrefillEndpoint(side(src_pool, {1: [5, 9]}), engine, mine, refuse=refuse)  # row 2: never allocated
    theirs.send("register", {"side": describe_side(decode_side), "staging": None}, b"meta")
    prefill.accept(timeout=1)
    messages = plan_destinations(decode_side, [PreallocatedRequest("r1", 1, 8), PreallocatedRequest("r2", 2, 8)]).messages()
    for request, message in zip(("r1", "r2"), messages):
        theirs.send("request", {"request": request, "prompt_len": 8, "prefix_len": 0}, message)
    prefill.receive_requests(2, timeout=1)
    chunks = [prefill.transfer(Chunk("r1", 1, 0, 9, 8, True)), prefill.transfer(Chunk("r2", 2, 0, 9, 8, True))]
    return prefill, engine, theirs, chunks


def _failures(channel):
    out = {}
    while (msg := channel.try_recv()) is not None:
        if msg[0] == "failed":
            out[msg[1]["request"]] = msg[1]["reason"]
    return out


def test_with_refuse_request_one_bad_request_fails_alone_and_the_rest_is_sent():
    prefill, engine, decode, chunks = _direct_pair("request")
    result = prefill.send(chunks, mode="direct", timeout=5)
    assert result["r1"] is None
    assert result["r2"].startswith("request refused:") and "unallocated" in result["r2"]
    assert set(_failures(decode)) == {"r2"}
    notes = [json.loads(note) for _, note in engine.posted]
    assert notes and all(note[0] == "r1" for note in notes), notes  # nothing of r2 was written


def test_by_default_one_bad_request_refuses_the_whole_batch():
    prefill, engine, decode, chunks = _direct_pair("batch")
    with pytest.raises(AllocatorInvariantError) as err:
        prefill.send(chunks, mode="direct", timeout=5)
    assert err.value.request == "r2" and not engine.posted
    assert set(_failures(decode)) == {"r1", "r2"}


def test_a_staged_run_whose_control_connection_was_made_again_fails_at_once():
    """A credit in flight on a lost connection is gone: the run must not wait out its deadline for it."""
    import time

    prefill, engine, mine, _, _, _buffers = _staged_pair()
    reconnected = []
    mine.replaced = lambda: bool(reconnected)
    engine.on_post = lambda descs, note: reconnected.append(True)  # the credit never comes
    started = time.monotonic()
    result = prefill.send([prefill.transfer(Chunk("r1", 1, 0, 9, 8, True))], mode="staged", timeout=20)
    assert "made again during the staged run" in (result["r1"] or ""), result
    assert time.monotonic() - started < 10


def test_chunks_announced_for_auto_are_withdrawn_when_it_sends_direct():
    """``auto`` announces the chunks when its last send was staged; this batch goes direct (on the CPU
    it always does), so they are withdrawn and the sections go as direct writes."""
    prefill, engine, _, theirs, _, _buffers = _staged_pair(plans=True)
    prefill.sending.last_mode = "staged"
    assert prefill.send([prefill.transfer(Chunk("r1", 1, 0, 9, 8, True))], mode="auto", timeout=5) == {"r1": None}
    sent = _sent(theirs)
    assert [kind for kind, _ in sent] == ["staged-plan", "staged-waves"], sent
    assert sent[1][1] == {"from": prefill.id, "run": sent[0][1]["run"], "cancel": "sent direct"}
    assert prefill.last_mode == "direct" and engine.posted


def test_an_abort_is_acknowledged_as_fenced_at_once_and_its_lists_dropped():
    """``send`` returns only once its writes ended, so an abort read between sends has nothing in
    flight: it is acknowledged ``fenced`` at once, for a request it knows (its lists are dropped, the
    caller told) and for one it has finished or never had (the decode may still wait on it)."""
    prefill, _, _, theirs, _, _buffers = _staged_pair()
    _sent(theirs)
    theirs.send("abort", {"request": "r1", "reason": "gone"})
    theirs.send("abort", {"request": "r9", "reason": "gone"})
    prefill.progress()
    assert "r1" not in prefill.lists and prefill.aborted == [(0, "r1", "gone")]
    assert list(prefill.given_up) == [(0, "r9")]  # (one it never had: its decode gave it up before publishing)
    assert _sent(theirs) == [("abort-ack", {"request": "r1", "fenced": True}),
                             ("abort-ack", {"request": "r9", "fenced": True})]


def test_a_request_spread_over_several_decode_endpoints_may_go_only_once_each_has_published():
    """A decode of a larger TP size publishes each request from every rank this sender serves; with one
    rank's lists in, the request must wait for the other's (sending it to one alone lost the other's part)."""
    src_pool, dst_pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8), torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    decode_side = side(dst_pool, {1: [3, 4]})
    (mine0, theirs0), (mine1, theirs1) = FakeChannel.pair(), FakeChannel.pair()
    prefill = PrefillEndpoint(side(src_pool, {1: [5, 9]}), FakeEngine(), [mine0, mine1])
    for theirs in (theirs0, theirs1):
        theirs.send("register", {"side": describe_side(decode_side), "staging": None}, b"meta")
    prefill.accept(timeout=1)
    message = plan_destinations(decode_side, [PreallocatedRequest("r1", 1, 8)]).messages()[0]
    for bad in ("2", True, 0, 1 << 20):  # (a malformed count fails its request, named)
        theirs0.send("request", {"request": f"bad-{bad}", "prompt_len": 8, "prefix_len": 0, "publishers": bad}, message)
    theirs0.send("request", {"request": "r1", "prompt_len": 8, "prefix_len": 0, "publishers": 2}, message)
    prefill.progress()
    assert not any(f"bad-{bad}" in prefill.peers[0].lists for bad in ("2", True, 0, 1 << 20))
    failed = [(header["request"], header["reason"]) for kind, header in _sent(theirs0) if kind == "failed"]
    assert [r for r, _ in failed] == [f"bad-{bad}" for bad in ("2", True, 0, 1 << 20)]
    assert all("publishers" in why for _, why in failed)
    assert not prefill.published_by_all("r1")
    theirs1.send("request", {"request": "r1", "prompt_len": 8, "prefix_len": 0, "publishers": 2}, message)
    prefill.progress()
    assert prefill.published_by_all("r1")
    prefill.forget(["r1"])
    assert "r1" not in prefill.publishers


def test_an_abort_of_a_request_with_a_write_that_could_not_be_ended_is_not_acknowledged_as_fenced(monkeypatch):
    monkeypatch.setenv("KVPLAN_DRAIN_S", "0.05")  # how long an aborted write may take to end
    prefill, engine, _, theirs, _, _buffers = _staged_pair(engine=FakeEngine(stuck=True, abort_after=None))
    _sent(theirs)
    result = prefill.send([prefill.transfer(Chunk("r1", 1, 0, 9, 8, True))], mode="direct", timeout=0.05)
    assert result["r1"].startswith("unsafe")
    _sent(theirs)
    theirs.send("abort", {"request": "r1", "reason": "gone"})
    prefill.progress()
    assert _sent(theirs) == [("abort-ack", {"request": "r1", "fenced": False})]


def test_a_wave_refused_before_it_is_posted_is_never_posted():
    """The receiver refuses wave 1 while wave 0 is being written; the refusal
    arrived before wave 1 was posted and was dropped, so wave 1 was written into the refused run.
    Now its request fails with the receiver's reason and wave 1 is never posted."""
    prefill, engine, _, theirs, _, _buffers = _staged_pair(plans=True, staging_bytes=1024)  # two waves

    def on_post(descs, note):
        wave = json.loads(note)["wave"]
        if wave == 0:
            theirs.send("wave-done", {"wave": 1, "error": "its table writes outside the published pages"})
            theirs.send("wave-done", {"wave": 0})

    engine.on_post = on_post
    result = prefill.send([prefill.transfer(Chunk("r1", 1, 0, 8, 8, True))], mode="staged", timeout=1)
    assert len(engine.posted) == 1
    assert "refused the wave: its table writes outside" in result["r1"]


def test_a_decode_endpoint_that_is_gone_leaves_nothing_behind_and_can_pair_again(monkeypatch):
    """A prefill kept every gone decode endpoint's lists and its engine
    connection (NIXL's remote agent) for as long as it ran."""
    prefill, engine, theirs, _ = _direct_pair("batch")
    assert len(prefill.lists) == 2
    channel = prefill.peers[0].channel
    monkeypatch.setattr(channel, "peer_gone", lambda: True, raising=False)
    prefill.progress()
    assert prefill.lists == {} and prefill.peers[0].dropped and engine.disconnected == ["peer"]
    prefill.progress()  # (once)
    assert engine.disconnected == ["peer"]
    monkeypatch.setattr(channel, "peer_gone", lambda: False, raising=False)
    decode_side = side(torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8), {1: [3, 4]})
    theirs.send("register", {"side": describe_side(decode_side), "staging": None}, b"meta")  # a restarted one
    prefill.progress()
    assert not prefill.peers[0].dropped and prefill.peers[0].name == "peer"
