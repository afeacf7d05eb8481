"""Post and poll on the prefill side (``PrefillEndpoint.submit``): the caller gets a handle while the
batch is still moving, batches end in order, the excess beyond ``max_in_flight`` is refused whole with
``overload`` (nothing written, its decode told), an abort read while a batch is queued keeps that
request's bytes from ever being written, and the caller's reads never touch the channels."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from kvplan.errors import AllocatorInvariantError
from kvplan.planner.device.destinations import PreallocatedRequest, plan_destinations
from kvplan.transport.prefill import Chunk, PrefillEndpoint
from kvplan.transport.registration import describe_side
from tests.transport.fakes import FakeChannel, FakeEngine
from tests.transport.test_prefill_protocol import PAGE_BYTES, side

WAIT_S = 30.0  # what a test waits at most for the thread (a loaded 2-core machine); a pass ends at once


class HeldEngine(FakeEngine):
    """A fake engine whose writes do not end until the test releases them: a slowed peer."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.first_post = threading.Event()

    def post(self, peer, descs, notification, reuse=None):
        self.first_post.set()
        return super().post(peer, descs, notification, reuse)

    def progress(self, handle):
        if not self.release.is_set():
            self.release.wait(0.001)  # (a bounded wait: the thread's wait loop comes back)
            return handle.state
        return super().progress(handle)


def _pair(requests=("r1", "r2", "r3"), max_in_flight=8, engine=None):
    """A prefill endpoint paired with an in-memory decode side that published ``requests`` (rows 1..n)."""
    src_pool, dst_pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8), torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    rows = {k + 1: [2 * k + 1, 2 * k + 2] for k in range(len(requests))}
    decode_side = side(dst_pool, rows)
    mine, theirs = FakeChannel.pair()
    engine = engine or HeldEngine()
    prefill = PrefillEndpoint(side(src_pool, {k: [p + 8 for p in v] for k, v in rows.items()}), engine, mine,
                              max_in_flight=max_in_flight)
    theirs.send("register", {"side": describe_side(decode_side), "staging": None}, b"meta")
    prefill.accept(timeout=1)
    published = [PreallocatedRequest(r, k + 1, 8) for k, r in enumerate(requests)]
    for r, message in zip(requests, plan_destinations(decode_side, published).messages()):
        theirs.send("request", {"request": r, "prompt_len": 8, "prefix_len": 0}, message)
    prefill.receive_requests(len(requests), timeout=1)
    chunks = {r: prefill.transfer(Chunk(r, k + 1, 0, 9, 8, True)) for k, r in enumerate(requests)}
    return prefill, engine, theirs, chunks, (src_pool, dst_pool)


def _messages(channel, kind):
    out = []
    while (msg := channel.try_recv()) is not None:
        if msg[0] == kind:
            out.append(msg[1])
    return out


def _posted_requests(engine):
    return {json.loads(note)[0] for _, note in engine.posted}


def test_submit_returns_while_its_batch_is_still_moving_and_the_handle_ends_with_it():
    prefill, engine, _, chunks, _keep = _pair()
    try:
        handle = prefill.submit([chunks["r1"]], mode="direct", timeout=WAIT_S)
        assert engine.first_post.wait(WAIT_S)  # the thread has posted it; its write is held
        assert not handle.done() and prefill.in_flight() == 1 and prefill.completed() == []
        with pytest.raises(TimeoutError):
            handle.result(timeout=0.01)
        engine.release.set()
        assert handle.result(timeout=WAIT_S) == {"r1": None}
        assert prefill.completed() == [handle] and prefill.in_flight() == 0
        assert prefill.stats()["requests"] == {"sent": 1}
    finally:
        prefill.close()


def test_batches_end_in_the_order_they_were_submitted():
    prefill, engine, _, chunks, _keep = _pair()
    try:
        handles = [prefill.submit([chunks[r]], mode="direct", timeout=WAIT_S) for r in ("r1", "r2", "r3")]
        engine.release.set()
        assert [h.result(timeout=WAIT_S) for h in handles] == [{"r1": None}, {"r2": None}, {"r3": None}]
        assert prefill.completed() == handles
        assert [json.loads(note)[0] for _, note in engine.posted] == ["r1", "r2", "r3"]
    finally:
        prefill.close()


def test_a_batch_beyond_max_in_flight_is_refused_whole_with_overload_and_its_decode_told():
    prefill, engine, decode, chunks, _keep = _pair(max_in_flight=1)
    try:
        first = prefill.submit([chunks["r1"]], mode="direct", timeout=WAIT_S)
        refused = prefill.submit([chunks["r2"], chunks["r3"]], mode="direct", timeout=WAIT_S)
        assert refused.done(), "an overloaded submit ends at once"
        reasons = refused.result(timeout=0)
        assert set(reasons) == {"r2", "r3"} and all("overload" in why for why in reasons.values()), reasons
        engine.release.set()
        assert first.result(timeout=WAIT_S) == {"r1": None}
        assert _posted_requests(engine) == {"r1"}  # nothing of the refused batch was written
        told = {m["request"]: m["reason"] for m in _wait_for(decode, "failed", 2)}
        assert set(told) == {"r2", "r3"} and all("overload" in why for why in told.values())
        assert prefill.stats()["failures"] == {"overload": 2}
    finally:
        prefill.close()


def test_refused_batches_queue_one_report_however_many_and_at_most_the_bound(monkeypatch):
    """Each refused batch's decodes are told, in one queued action for all the refusals of a moment (2,000
    refused submits queued 2,000 actions), and at most MAX_UNTOLD_REFUSALS requests wait to be told: past it
    they are counted (``untold``), and their decode fails them at its own deadline."""
    from kvplan.transport import progress_thread

    monkeypatch.setattr(progress_thread, "MAX_UNTOLD_REFUSALS", 1)
    prefill, engine, decode, chunks, _keep = _pair(max_in_flight=1)
    try:
        prefill.start()
        thread = prefill._thread
        run_actions = thread._run_actions
        thread._run_actions = lambda: False  # (the thread takes no action meanwhile: the refusals pile up)
        first = prefill.submit([chunks["r1"]], mode="direct", timeout=WAIT_S)
        for _ in range(200):
            assert prefill.submit([chunks["r2"], chunks["r3"]], mode="direct", timeout=WAIT_S).done()
        assert len(thread._actions) == 1 and len(thread._to_tell) == 1 and thread.untold == 2 * 200 - 1
        thread._run_actions = run_actions
        engine.release.set()
        assert first.result(timeout=WAIT_S) == {"r1": None}
        told = {m["request"] for m in _wait_for(decode, "failed", 1)}
        assert len(told) == 1 and told <= {"r2", "r3"}
    finally:
        prefill.close()


def _wait_until(condition):
    import time

    deadline = time.monotonic() + WAIT_S
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)


def _wait_for(channel, kind, count):
    import time

    got, deadline = [], time.monotonic() + WAIT_S
    while len(got) < count and time.monotonic() < deadline:
        got += _messages(channel, kind)
        time.sleep(0.005)
    return got


def test_an_abort_read_while_its_batch_waits_in_the_queue_keeps_its_bytes_from_being_written():
    prefill, engine, decode, chunks, _keep = _pair()
    try:
        first = prefill.submit([chunks["r1"]], mode="direct", timeout=WAIT_S)
        second = prefill.submit([chunks["r2"]], mode="direct", timeout=WAIT_S)
        _wait_until(lambda: _posted_requests(engine) == {"r1", "r2"})  # (two batches move at once)
        queued = prefill.submit([chunks["r3"]], mode="direct", timeout=WAIT_S)
        decode.send("abort", {"request": "r3", "reason": "the decode gave it up"})
        engine.release.set()
        assert first.result(timeout=WAIT_S) == {"r1": None} and second.result(timeout=WAIT_S) == {"r2": None}
        assert "aborted it before its batch was sent" in queued.result(timeout=WAIT_S)["r3"]
        assert _posted_requests(engine) == {"r1", "r2"}  # r3 was never written
        acks = _wait_for(decode, "abort-ack", 1)
        assert acks == [{"request": "r3", "fenced": True}]
        prefill.progress()
        assert prefill.aborted == [(0, "r3", "the decode gave it up")]
    finally:
        prefill.close()


def test_an_abort_of_a_request_whose_write_is_in_flight_is_acknowledged_once_the_write_ended():
    """The acknowledgement is the fence: with a batch moving to the decode, it waits for that batch's writes."""
    prefill, engine, decode, chunks, _keep = _pair()
    try:
        moving = prefill.submit([chunks["r1"], chunks["r2"]], mode="direct", timeout=WAIT_S)
        assert engine.first_post.wait(WAIT_S)
        decode.send("abort", {"request": "r2", "reason": "the decode gave it up"})
        assert _wait_for_none(decode, "abort-ack", 0.3)  # (held: r2's write is in flight)
        engine.release.set()
        assert moving.result(timeout=WAIT_S) == {"r1": None, "r2": None}
        assert _wait_for(decode, "abort-ack", 1) == [{"request": "r2", "fenced": True}]
    finally:
        prefill.close()


def _wait_for_none(channel, kind, seconds):
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if _messages(channel, kind):
            return False
        time.sleep(0.005)
    return True


def test_lists_that_arrive_reach_the_caller_through_progress_without_it_reading_a_channel():
    prefill, engine, decode, chunks, (src_pool, dst_pool) = _pair(requests=("r1",))
    try:
        engine.release.set()
        assert prefill.submit([chunks["r1"]], mode="direct", timeout=WAIT_S).result(timeout=WAIT_S) == {"r1": None}
        decode_side = side(dst_pool, {2: [5, 6]})
        message = plan_destinations(decode_side, [PreallocatedRequest("r4", 2, 8)]).messages()[0]
        readers = set()
        channel, read = prefill.channel, prefill.channel.try_recv

        def try_recv():
            readers.add(threading.current_thread().name)
            return read()

        channel.try_recv = try_recv
        decode.send("request", {"request": "r4", "prompt_len": 8, "prefix_len": 0}, message)
        prefill.receive_requests(1, timeout=WAIT_S)
        assert "r4" in prefill.lists and prefill.progress() == []  # (receive_requests took it)
        decode.send("abort", {"request": "r4", "reason": "gone"})
        _wait_until(lambda: prefill.progress() or prefill.aborted)
        assert prefill.aborted == [(0, "r4", "gone")]
        assert readers == {"kvplan-prefill-progress"}, readers
    finally:
        prefill.close()


def test_send_after_a_submit_goes_through_the_thread_and_a_bad_batch_raises_from_result():
    prefill, engine, decode, chunks, _keep = _pair(requests=("r1", "r2"))
    try:
        engine.release.set()
        assert prefill.submit([chunks["r1"]], mode="direct", timeout=WAIT_S).result(timeout=WAIT_S) == {"r1": None}
        assert prefill.send([chunks["r2"]], mode="direct", timeout=WAIT_S) == {"r2": None}
        bad = prefill.transfer(Chunk("r1", 3, 0, 9, 8, True))  # row 3 holds no pages
        handle = prefill.submit([bad], mode="direct", timeout=WAIT_S)
        with pytest.raises(AllocatorInvariantError):
            handle.result(timeout=WAIT_S)
        with pytest.raises(RuntimeError, match="before the first submit"):
            prefill.accept(timeout=1)
    finally:
        prefill.close()


def test_a_request_its_decode_refused_before_publishing_it_reaches_the_caller_with_the_reason():
    """DecodeEndpoint.refuse: an admission bound on the decode side (a full queue) refuses a request it
    never published; its sender keeps it in ``refused``, unacknowledged (nothing of it exists to fence).
    Several refused at once travel in one message; one the decode did publish is taken as aborted."""
    from kvplan.transport.decode import DecodeEndpoint

    prefill, engine, decode, chunks, (src_pool, dst_pool) = _pair(requests=("r1",))
    endpoint = DecodeEndpoint(side(dst_pool, {1: [1, 2]}), FakeEngine(), decode)
    endpoint.refuse("r9", "overload: 3 requests wait for a row here")
    prefill.progress()
    assert list(prefill.refused) == [(0, "r9", "overload: 3 requests wait for a row here")]
    assert _messages(decode, "abort-ack") == []  # nothing of r9 exists to fence
    endpoint.refuse_all(["r10", "r11", "r1"], "overload: full")
    prefill.progress()
    assert [r for _, r, _ in prefill.refused] == ["r9", "r10", "r11"]
    assert _messages(decode, "abort-ack") == [{"request": "r1", "fenced": True}]  # r1 was published: aborted
    assert not prefill.published_by_all("r1")
    assert endpoint.stats()["failures"] == {"overload": 4}


def test_a_busy_peer_s_messages_are_held_by_request_and_in_order():
    """What waits while a peer's writes are in flight (``DecodeMessages._holds``): an abort or refusal of a
    request being written (its acknowledgement is its fence), a registration while anything is written,
    and what follows a held message of the same request or a held registration; the rest goes through."""
    from kvplan.transport.prefill_messages import DecodeMessages

    holds = DecodeMessages._holds
    abort = lambda r: ("abort", {"request": r}, [])  # noqa: E731
    request = lambda r: ("request", {"request": r}, [])  # noqa: E731
    refuse = ("refuse", {"requests": ["r9", "r2"]}, [])
    register = ("register", {}, [])
    moving = {"r1", "r2"}
    assert holds(moving, abort("r1"), []) and not holds(moving, abort("r3"), [])
    assert holds(moving, refuse, []) and not holds(set(), refuse, [])
    assert holds(moving, register, []) and not holds(set(), register, [])
    assert not holds(moving, request("r3"), [])
    assert holds(moving, request("r1"), [abort("r1")])  # (published again after its held abort: after it)
    assert holds(moving, request("r3"), [register]) and holds(set(), register, [register])
