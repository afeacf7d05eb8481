"""The decode endpoint's progress thread (``DecodeEndpoint.start``): once started, the caller's calls
launch, enqueue or read and return; the thread finishes publishes (lists checked, tracked, sent in
order), takes engine notes, keeps deadlines and fences; the caller never touches a channel."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from kvplan.planner.device.destinations import PreallocatedRequest, PublishedRequest
from kvplan.planner.contract.batch import Attention, Entry, KVLayout, SideMemory
from kvplan.planner.contract.plan import KV_ROLE, DestinationLists, Section
from kvplan.transport.completion import encode_notification
from kvplan.transport.decode import DecodeEndpoint
from tests.planner.builders import table_with
from tests.transport.fakes import FakeChannel, FakeEngine

PAGE, PAGE_BYTES = 4, 256
WAIT_S = 30.0  # the most a test waits for the thread (a loaded 2-core machine); a pass ends at once


class WatchedChannel(FakeChannel):
    """An in-memory channel that records which threads used it."""

    def __init__(self):
        super().__init__()
        self.users: set[str] = set()

    def send(self, *args, **kwargs):
        self.users.add(threading.current_thread().name)
        return super().send(*args, **kwargs)

    def try_recv(self):
        self.users.add(threading.current_thread().name)
        return super().try_recv()

    def peer_gone(self):
        self.users.add(threading.current_thread().name)
        return False


def _started(rows=None, on_complete=None):
    pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    side = SideMemory(KVLayout(Attention.MLA, PAGE, (Entry(pool.data_ptr(), PAGE_BYTES, 16),)),
                      req_to_token=table_with(rows or {1: [3, 4], 2: [5, 6]}, PAGE, max_ctx=16))
    mine, theirs = WatchedChannel(), FakeChannel()
    mine.other, theirs.other = theirs, mine
    endpoint = DecodeEndpoint(side, FakeEngine(), mine, on_complete=on_complete)
    endpoint.register(timeout=1)
    assert theirs.try_recv()[0] == "register"
    mine.users.clear()  # (registering talks on the caller's thread: before start)
    endpoint.start()
    return endpoint, mine, theirs


def _until(condition, what):
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"the progress thread never {what}"
        time.sleep(0.001)


def _ended(endpoint, requests, what):
    """What ``endpoint.poll()`` returned until every one of ``requests`` had ended (failing with ``what``)."""
    ended = {}
    _until(lambda: ended.update(endpoint.poll()) or set(requests) <= set(ended), what)
    return ended


def _received(channel, kind, count):
    got = []
    def look():
        while (msg := channel.try_recv()) is not None:
            if msg[0] == kind:
                got.append(msg[1])
        return len(got) >= count
    _until(look, f"sent {count} {kind!r}")
    return got


def test_publish_returns_and_the_thread_sends_the_lists_and_completes_the_request_from_its_note():
    endpoint, mine, prefill = _started()
    try:
        endpoint.publish([PreallocatedRequest("r1", row=1, prompt_len=8), PreallocatedRequest("r2", row=2, prompt_len=8)],
                         timeout=WAIT_S)
        headers = _received(prefill, "request", 2)
        assert [h["request"] for h in headers] == ["r1", "r2"]  # in the order published, one publish
        assert endpoint.poll() == {}
        endpoint.engine.inbox.append(encode_notification(Section(0, "r1", KV_ROLE, "kv", 0, 1, 2)))
        ended = _ended(endpoint, ["r1"], "completed r1")
        assert ended == {"r1": None}
        assert endpoint.stats()["requests"]["complete"] == 1
        assert "MainThread" not in mine.users, "the caller touched a channel of a started endpoint"
    finally:
        endpoint.close()


@pytest.mark.parametrize("fails", [False, True])
def test_on_complete_runs_on_the_thread_before_a_request_is_reported_and_what_it_raises_fails_it(fails):
    """SGLang's adapter copies a request's aux rows out of their device mirror here: a request is reported
    complete only after the hook has run for it, on the progress thread; a hook that raises fails it, named."""
    seen = []

    def on_complete(requests):
        seen.append((list(requests), threading.current_thread().name))
        if fails:
            raise TimeoutError("the copy did not end")

    endpoint, _, prefill = _started(on_complete=on_complete)
    try:
        endpoint.publish([PreallocatedRequest("r1", row=1, prompt_len=8)], timeout=WAIT_S)
        _received(prefill, "request", 1)
        assert seen == []
        endpoint.engine.inbox.append(encode_notification(Section(0, "r1", KV_ROLE, "kv", 0, 1, 2)))
        ended = _ended(endpoint, ["r1"], "ended r1")
        assert seen == [(["r1"], "kvplan-decode-progress")]
        if fails:
            assert "on_complete failed: TimeoutError: the copy did not end" in ended["r1"]
            assert endpoint.tracker.state("r1") == "failed"  # (wait() and the fences read the tracker)
        else:
            assert ended == {"r1": None}
    finally:
        endpoint.close()


def test_an_abort_from_the_caller_is_sent_by_the_thread_and_fences_on_the_sender_s_answer():
    endpoint, mine, prefill = _started()
    try:
        endpoint.publish([PreallocatedRequest("r1", row=1, prompt_len=8)], timeout=WAIT_S)
        _received(prefill, "request", 1)
        endpoint.abort("r1", "the client went away")
        assert _received(prefill, "abort", 1)[0]["request"] == "r1"
        assert not endpoint.fenced("r1")
        ended = _ended(endpoint, ["r1"], "ended the aborted request")
        assert ended["r1"] == "the client went away"
        prefill.send("abort-ack", {"request": "r1", "fenced": True})
        _until(lambda: endpoint.fenced("r1"), "fenced r1 on its acknowledgement")
        endpoint.forget("r1")
        _until(lambda: endpoint.footprint()["fences"] == 0 and endpoint.footprint()["tracked"] == 0, "forgot r1")
        assert "MainThread" not in mine.users
    finally:
        endpoint.close()


def test_a_deadline_is_kept_by_the_thread_with_no_call_of_the_caller():
    endpoint, _, prefill = _started()
    try:
        endpoint.publish([PreallocatedRequest("r1", row=1, prompt_len=8)], timeout=0.05)
        abort = _received(prefill, "abort", 1)[0]  # the thread told the sender, the caller did nothing
        assert abort["request"] == "r1" and "deadline" in abort["reason"]
        ended = endpoint.poll()
        assert "deadline" in ended["r1"]
    finally:
        endpoint.close()


def test_a_publish_to_a_sender_that_is_gone_fails_at_once_and_holds_nothing_up():
    """A send to a lost peer waits for a new one until its deadline (a bound channel): the progress thread
    would stand still for the request's whole deadline. Its lists are not sent: the request fails at once,
    named, and a later publish to a sender that is there goes on."""
    endpoint, mine, prefill = _started()
    sends = []
    try:
        mine.peer_gone = lambda: True
        real_send = mine.send
        mine.send = lambda *args, **kwargs: sends.append(args[0]) or real_send(*args, **kwargs)
        started = time.monotonic()
        endpoint.publish([PreallocatedRequest("r1", row=1, prompt_len=8)], timeout=WAIT_S)
        ended = _ended(endpoint, ["r1"], "failed r1")
        assert "control connection" in ended["r1"] and "request" not in sends
        assert time.monotonic() - started < WAIT_S / 2
        mine.peer_gone = lambda: False
        endpoint.publish([PreallocatedRequest("r2", row=2, prompt_len=8)], timeout=WAIT_S)
        assert [h["request"] for h in _received(prefill, "request", 1)] == ["r2"]
    finally:
        endpoint.close()


def test_a_list_the_kernels_refuse_fails_every_request_of_its_publish_naming_it_and_sends_nothing():
    endpoint, _, prefill = _started(rows={1: [3, 4], 2: [5, 99]})  # row 2's page 99 is outside the 16-page pool
    try:
        endpoint.publish([PreallocatedRequest("r1", row=1, prompt_len=8)], timeout=WAIT_S)
        _received(prefill, "request", 1)
        endpoint.publish([PreallocatedRequest("r3", row=1, prompt_len=4), PreallocatedRequest("r2", row=2, prompt_len=8)],
                         timeout=WAIT_S)
        ended = _ended(endpoint, {"r2", "r3"}, "failed the bad publish")
        assert all(ended[r] and "refused" in ended[r] and "'r2'" in ended[r] for r in ("r2", "r3")), ended
        assert prefill.try_recv() is None  # nothing of it was sent
    finally:
        endpoint.close()


def test_calls_that_talk_on_the_caller_s_thread_are_refused_once_started():
    endpoint, _, _ = _started()
    try:
        with pytest.raises(RuntimeError, match="before start"):
            endpoint.register(timeout=1)
        with pytest.raises(RuntimeError, match="before start"):
            endpoint.warm_up()
    finally:
        endpoint.close()


def test_a_started_endpoint_takes_senders_and_publishes_lists_of_its_caller_from_its_thread():
    """An engine's decode (SGLang's) makes its endpoint at start with no sender, starts it, and attaches
    each prefill rank as it is found: ``add_sender`` gives the index at once and the thread registers; lists
    the caller made itself (``publish_lists``) are tracked and sent by the thread to their sender alone, and
    the request completes from that sender's note. The caller touches no channel."""
    pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    side = SideMemory(KVLayout(Attention.MLA, PAGE, (Entry(pool.data_ptr(), PAGE_BYTES, 16),)),
                      req_to_token=table_with({1: [3, 4]}, PAGE, max_ctx=16))
    endpoint = DecodeEndpoint(side, FakeEngine(), [])
    endpoint.start()
    channels = []
    try:
        for k in range(2):
            mine, theirs = WatchedChannel(), FakeChannel()
            mine.other, theirs.other = theirs, mine
            channels.append((mine, theirs))
            assert endpoint.add_sender(mine, timeout=WAIT_S) == k
        for k, (_, prefill) in enumerate(channels):
            header = _received(prefill, "register", 1)[0]
            assert header.get("peer", 0) == k
        lists = PublishedRequest(9, DestinationLists(np.array([5, 6], np.int64), ()), 0, (), False)
        endpoint.publish_lists([lists], prefix_lens=[4], timeout=WAIT_S, peer=1)
        header = _received(channels[1][1], "request", 1)[0]
        assert (header["request"], header["prefix_len"], header["prompt_len"]) == (9, 4, 4 + 2 * PAGE)
        assert channels[0][1].try_recv() is None  # published to its own sender only
        endpoint.engine.inbox.append(encode_notification(Section(0, 9, KV_ROLE, "kv", 0, 1, 2)))
        ended = _ended(endpoint, [9], "completed request 9")
        assert ended == {9: None}
        assert all("MainThread" not in mine.users for mine, _ in channels)
    finally:
        endpoint.close()


def _held(endpoint):
    """Hold the progress thread in a queued action until the returned event is set."""
    gate, holding = threading.Event(), threading.Event()
    endpoint._progress.call(lambda: (holding.set(), gate.wait(WAIT_S)))
    _until(holding.is_set, "ran the holding action")
    return gate


def test_publishes_queued_in_one_turn_are_launched_together_and_each_is_sent_in_order(monkeypatch):
    from kvplan.transport import decode_thread

    endpoint, _, prefill = _started(rows={1: [3, 4], 2: [5, 6], 3: [7, 8]})
    launched = []
    plan = decode_thread.plan_lists
    monkeypatch.setattr(decode_thread, "plan_lists", lambda side, requests, after=(): launched.append(
        [r.request for r in requests]) or plan(side, requests, after))
    try:
        gate = _held(endpoint)
        for k in (1, 2, 3):
            endpoint.publish([PreallocatedRequest(f"r{k}", row=k, prompt_len=8)], timeout=WAIT_S)
        gate.set()
        headers = _received(prefill, "request", 3)
        assert [h["request"] for h in headers] == ["r1", "r2", "r3"]
        assert launched == [["r1", "r2", "r3"]]  # one launch for the three publishes
    finally:
        endpoint.close()


def test_a_refused_list_among_publishes_launched_together_fails_its_own_publish_alone():
    endpoint, _, prefill = _started(rows={1: [3, 4], 2: [5, 99], 3: [7, 8]})  # row 2's page 99 is outside the pool
    try:
        gate = _held(endpoint)
        for k in (1, 2, 3):
            endpoint.publish([PreallocatedRequest(f"r{k}", row=k, prompt_len=8)], timeout=WAIT_S)
        gate.set()
        headers = _received(prefill, "request", 2)
        assert [h["request"] for h in headers] == ["r1", "r3"]
        ended = _ended(endpoint, ["r2"], "failed r2")
        assert "refused" in ended["r2"] and "'r2'" in ended["r2"] and "r1" not in ended and "r3" not in ended
    finally:
        endpoint.close()


def test_a_request_its_lengths_show_is_bad_raises_at_publish_on_a_started_endpoint():
    from kvplan.errors import AlignmentError

    endpoint, _, prefill = _started()
    try:
        with pytest.raises(AlignmentError, match="r9"):
            endpoint.publish([PreallocatedRequest("r9", row=1, prompt_len=8, prefix_len=1)], timeout=WAIT_S)
        assert endpoint._progress.pending_publishes() == 0 and prefill.try_recv() is None
    finally:
        endpoint.close()
