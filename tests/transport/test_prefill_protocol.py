"""The sender's side of staged mode with an in-memory engine and channel: messages that are not
credits (the next requests' lists) survive a staged send and reach receive_requests; a run the
receiver plans goes as its chunks, then its waves, and chunks of a batch not sent staged are withdrawn."""

import json

import pytest
import torch

from kvplan.errors import AllocatorInvariantError
from kvplan.planner.destinations import PreallocatedRequest, plan_destinations
from kvplan.planner.model import Attention, Entry, KVLayout, SideMemory
from kvplan.transport.control import ControlTimeout
from kvplan.transport.prefill import Chunk, PrefillEndpoint
from kvplan.transport.registration import describe_side
from tests.planner.builders import table_with
from tests.transport.fakes import FakeChannel, FakeEngine

PAGE, PAGE_BYTES = 4, 256


def side(pool, rows):
    return SideMemory(KVLayout(Attention.MLA, PAGE, (Entry(pool.data_ptr(), PAGE_BYTES, 16),)),
                      req_to_token=table_with(rows, PAGE, max_ctx=16))


def _staged_pair(plans: bool = False):
    """A prefill endpoint paired with a fake decode side that has staging, r1's lists received (with
    ``plans``: published with a row, so the decode plans r1's staged runs itself); the pools and
    staging buffers are returned to keep them alive."""
    src_pool, dst_pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8), torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    decode_side = side(dst_pool, {1: [3, 4], 2: [6, 7]})
    mine, theirs = FakeChannel.pair()
    engine = FakeEngine()
    staging, peer_staging = torch.zeros(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    prefill = PrefillEndpoint(side(src_pool, {1: [5, 9]}), engine, mine, staging)
    theirs.send("register", {"side": describe_side(decode_side), "staging": [peer_staging.data_ptr(), 4096]}, b"meta")
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
    prefill.last_mode = "staged"
    assert prefill.send([prefill.transfer(Chunk("r1", 1, 0, 9, 8, True))], mode="auto", timeout=5) == {"r1": None}
    sent = _sent(theirs)
    assert [kind for kind, _ in sent] == ["staged-plan", "staged-waves"], sent
    assert sent[1][1] == {"from": prefill.id, "run": sent[0][1]["run"], "cancel": "sent direct"}
    assert prefill.last_mode == "direct" and engine.posted
