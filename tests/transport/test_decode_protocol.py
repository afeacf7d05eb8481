"""The receiver's side of staged mode and its bookkeeping, with an in-memory engine and channel.

* a wave whose table writes outside what was published is refused, and nothing is written;
* the slot's credit is sent before the request can be seen complete (the staged race);
* settled requests are pruned: a thousand batches leave nothing behind.
"""

import dataclasses
import time
import tracemalloc

import numpy as np
import pytest
import torch

from kvplan.planner.device.destinations import PreallocatedRequest, plan_destinations
from kvplan.errors import LayoutError
from kvplan.planner.contract.batch import Attention, Entry, KVLayout, SideMemory
from kvplan.transport.completion import encode_notification
from kvplan.transport.decode import DecodeEndpoint
from kvplan.transport.registration import describe_side
from kvplan.transport.waves import credit_note, wave_note
from kvplan.planner.contract.plan import KV_ROLE, Section
from tests.planner.builders import table_with
from tests.transport.fakes import FakeChannel, FakeEngine, NotifyingFakeEngine

PAGE, PAGE_BYTES = 4, 256


@pytest.fixture
def decode():
    pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    side = SideMemory(KVLayout(Attention.MLA, PAGE, (Entry(pool.data_ptr(), PAGE_BYTES, 16),)),
                      req_to_token=table_with({1: [3, 4]}, PAGE, max_ctx=16))
    staging = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
    mine, theirs = FakeChannel.pair()
    endpoint = DecodeEndpoint(side, FakeEngine(), mine, staging)
    published = plan_destinations(side, [PreallocatedRequest("r1", row=1, prompt_len=8)]).result()
    endpoint.track(published, time.monotonic() + 30)
    return endpoint, theirs, pool, published[0]


def _announce(channel, rows, wave=7, staging_lo=0, pages=2):
    """A run of one wave, as the sender announces it (waves.run_message)."""
    table = np.array(rows, np.uint64)
    header = {"from": "p0", "alignment": 16, "requests": [["r1", 0, len(rows)]],
              "waves": [[wave, staging_lo, 0, len(rows), int(table[:, 1].sum()), [["r1", KV_ROLE, "kv", pages]]]]}
    channel.send("staged", header, table.tobytes())


def test_a_wave_inside_the_published_pages_is_scattered_and_credited_before_completion(decode):
    endpoint, prefill, pool, _ = decode
    base = pool.data_ptr()
    _announce(prefill, [[base + 3 * PAGE_BYTES, 2 * PAGE_BYTES]])
    endpoint.engine.inbox.append(wave_note(7, "p0"))
    states = endpoint.wait()
    assert states == {"r1": "complete"}
    assert prefill.try_recv()[0:2] == ("wave-done", {"wave": 7})  # the credit went out first
    expected = torch.arange(512, dtype=torch.int64).to(torch.uint8)
    assert torch.equal(pool[3 * PAGE_BYTES : 5 * PAGE_BYTES], expected)
    assert int(pool[: 3 * PAGE_BYTES].sum()) == 0 and int(pool[5 * PAGE_BYTES :].sum()) == 0


def test_a_sender_that_takes_credits_through_the_engine_gets_them_there_but_the_last_on_the_channel():
    """Both engines notify: the registration says so, and the sender's pairing carries its engine
    metadata. Of two waves that land together, the first's credit goes as an engine notification;
    the second is the last this side knows of from that sender, and its credit goes on the control
    channel (an engine notification leaves only while this side keeps polling the engine)."""
    pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    side = SideMemory(KVLayout(Attention.MLA, PAGE, (Entry(pool.data_ptr(), PAGE_BYTES, 16),)),
                      req_to_token=table_with({1: [3, 4]}, PAGE, max_ctx=16))
    mine, prefill = FakeChannel.pair()
    engine = NotifyingFakeEngine()
    endpoint = DecodeEndpoint(side, engine, mine, torch.arange(4096, dtype=torch.int64).to(torch.uint8))
    endpoint.register(timeout=1)
    assert prefill.try_recv()[1]["notifies"] is True
    prefill.send("paired", {"from": "p0", "side": describe_side(side), "credits": "engine"}, b"prefill-metadata")
    endpoint.track(plan_destinations(side, [PreallocatedRequest("r1", row=1, prompt_len=8)]).result(),
                   time.monotonic() + 30)
    _announce(prefill, [[pool.data_ptr() + 3 * PAGE_BYTES, PAGE_BYTES]], wave=7, pages=1)
    _announce(prefill, [[pool.data_ptr() + 4 * PAGE_BYTES, PAGE_BYTES]], wave=8, staging_lo=1024, pages=1)
    endpoint.poll()  # both tables read before either lands
    engine.inbox += [wave_note(7, "p0"), wave_note(8, "p0")]
    assert endpoint.wait() == {"r1": "complete"}
    assert engine.connected == [b"prefill-metadata"] and engine.notified == [("peer", credit_note(7))]
    assert prefill.try_recv()[0:2] == ("wave-done", {"wave": 8}) and prefill.try_recv() is None
    staged = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
    assert torch.equal(pool[3 * PAGE_BYTES : 4 * PAGE_BYTES], staged[:PAGE_BYTES])
    assert torch.equal(pool[4 * PAGE_BYTES : 5 * PAGE_BYTES], staged[1024 : 1024 + PAGE_BYTES])


@pytest.mark.parametrize("rows, why", [
    ([[5 * PAGE_BYTES, 2 * PAGE_BYTES]], "a page nobody published"),
    ([[3 * PAGE_BYTES, 3 * PAGE_BYTES]], "one page past the published run"),
])
def test_a_wave_that_writes_outside_the_published_pages_is_refused(decode, rows, why):
    endpoint, prefill, pool, _ = decode
    base = pool.data_ptr()
    _announce(prefill, [[base + a, n] for a, n in rows])
    endpoint.engine.inbox.append(wave_note(7, "p0"))
    states = endpoint.wait()
    assert states == {"r1": "failed"} and "refused staged run" in endpoint.failures["r1"]
    kind, header, _ = prefill.try_recv()
    assert kind == "wave-done" and "outside what this side published" in header["error"]
    assert int(pool.sum()) == 0, "bytes were written outside the published pages"


def test_a_wave_beyond_the_staging_buffer_is_refused(decode):
    endpoint, prefill, pool, _ = decode
    _announce(prefill, [[pool.data_ptr() + 3 * PAGE_BYTES, 2 * PAGE_BYTES]], staging_lo=4096 - 256)
    endpoint.wait()
    assert "staging buffer holds" in endpoint.failures["r1"] and int(pool.sum()) == 0


def test_settled_requests_are_pruned_over_a_thousand_batches(decode):
    endpoint, _, _, published = decode
    section = Section(0, "r1", KV_ROLE, "kv", 0, 1, len(published.lists.pages))

    def one_batch(k):
        request = f"q{k}"
        endpoint.track([dataclasses.replace(published, request=request)], time.monotonic() + 30)
        endpoint.engine.inbox.append(encode_notification(dataclasses.replace(section, request=request)))
        assert endpoint.wait()[request] == "complete"

    endpoint.engine.inbox.append(encode_notification(section))
    endpoint.wait()
    for k in range(100):
        one_batch(k)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for k in range(100, 1100):
        one_batch(k)
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    assert len(endpoint.tracker) == 0 and len(endpoint.guard) == 0
    assert grown < 64 << 10, f"{grown} bytes kept by 1,000 settled batches"


def test_a_wave_that_lands_on_a_slot_before_its_credit_is_refused(decode):
    endpoint, prefill, pool, _ = decode
    base = pool.data_ptr()
    rows = np.array([[base + 3 * PAGE_BYTES, PAGE_BYTES], [base + 4 * PAGE_BYTES, PAGE_BYTES]], np.uint64)
    header = {"from": "p0", "alignment": 16, "requests": [["r1", 0, 2]],
              "waves": [[7, 0, 0, 1, PAGE_BYTES, []], [8, 0, 1, 2, PAGE_BYTES, [["r1", KV_ROLE, "kv", 2]]]]}
    prefill.send("staged", header, rows.tobytes())
    endpoint.engine.inbox += [wave_note(7, "p0"), wave_note(8, "p0")]  # both on slot 0, no credit between
    states = endpoint.wait()
    assert states == {"r1": "failed"} and "has not freed" in endpoint.failures["r1"]
    assert int(pool[4 * PAGE_BYTES :].sum()) == 0, "the early wave was scattered"


@pytest.mark.parametrize("header", [
    {"from": "p0", "alignment": 16, "requests": [["r1", 0]], "waves": [[7, 0, 0, 1, 512, []]]},
    {"from": "p0", "alignment": "x", "requests": [["r1", 0, 1]], "waves": [[7, 0, 0, 1, 512, []]]},
    {"from": "p0", "alignment": 16, "requests": [["r1", 0, 1]], "waves": [[7, 0, 0, 1]]},
    {"alignment": 16, "requests": [["r1", 0, 1]], "waves": []},
])
def test_a_malformed_announcement_is_refused_not_a_crash(decode, header):
    endpoint, prefill, pool, _ = decode
    prefill.send("staged", header, np.array([[pool.data_ptr() + 3 * PAGE_BYTES, 512]], np.uint64).tobytes())
    endpoint.poll()  # raises nothing
    assert int(pool.sum()) == 0 and not endpoint._waves


def test_a_landed_wave_whose_table_never_comes_is_forgotten(decode, monkeypatch):
    """The bytes' notification of a wave whose announcement was refused or lost waits a while for
    its table, then is dropped: the receiver's bookkeeping does not grow with lost waves."""
    import kvplan.transport.decode_messages as decode_messages

    endpoint, _, _, _ = decode
    endpoint.engine.inbox.append(wave_note(41, "p0"))
    endpoint.poll()
    assert len(endpoint._early) == 1  # kept while its table may still be on the socket
    monkeypatch.setattr(decode_messages, "EARLY_KEEP_S", 0.0)
    time.sleep(0.01)
    endpoint.poll()
    assert not endpoint._early


@pytest.mark.skipif(not torch.cuda.is_available(), reason="scatter graphs are captured on a GPU only")
def test_a_failed_scatter_capture_falls_back_but_kvplan_s_own_errors_propagate():
    """A capture that fails (any error of CUDA or Triton) turns graphs off and the wave is launched
    instead; a wave that fails kvplan's own checks is an error, not a capture failure."""
    import types

    from kvplan.errors import PeerError

    def endpoint(error):
        def scatter(wave):
            raise error

        return types.SimpleNamespace(_graphs=True, _capture_stream=torch.cuda.Stream(), _scatter=scatter)

    refused = endpoint(PeerError("a wave outside its share"))
    with pytest.raises(PeerError, match="outside its share"):
        DecodeEndpoint._capture(refused, None)
    assert refused._graphs
    broken = endpoint(RuntimeError("operation not permitted when stream is capturing"))
    assert DecodeEndpoint._capture(broken, None) is None and not broken._graphs


@pytest.mark.parametrize("raw", [b"garbage", b"\xff\xfe", b"[1, 2]", b'{"wave": "x", "from": "p0"}', b"7",
                                 b'{"from": "zero", "note": ["r1", 0, "kv", 1]}', b'"abcd"'])
def test_a_malformed_engine_notification_is_dropped_not_a_crash(decode, raw):
    """What a peer's engine delivers is parsed under suspicion; the endpoint goes on."""
    endpoint, prefill, pool, _ = decode
    endpoint.engine.inbox.append(raw)
    endpoint.poll()
    base = pool.data_ptr()
    _announce(prefill, [[base + 3 * PAGE_BYTES, 2 * PAGE_BYTES]])
    endpoint.engine.inbox.append(wave_note(7, "p0"))
    assert endpoint.wait() == {"r1": "complete"}


def test_a_sender_that_cannot_take_its_credit_fails_its_requests_not_the_endpoint(decode):
    """A credit to a dead sender raised ControlTimeout out of poll() after the channel's
    send timeout; now the send gives up at once and the sender's unsettled requests fail."""
    from kvplan.transport.control import ControlTimeout

    endpoint, prefill, pool, _ = decode
    published = plan_destinations(endpoint.side, [PreallocatedRequest("r2", row=1, prompt_len=8)]).result()
    endpoint.track(published, time.monotonic() + 30)  # a second request of that sender, not yet sent

    def gone(*args, **kwargs):
        raise ControlTimeout("the peer did not take a 'wave-done' message within 1 ms")
    endpoint.channels[0].send = gone
    _announce(prefill, [[pool.data_ptr() + 3 * PAGE_BYTES, 2 * PAGE_BYTES]])
    endpoint.engine.inbox.append(wave_note(7, "p0"))
    started = time.monotonic()
    states = endpoint.wait()
    assert time.monotonic() - started < 5
    assert states["r2"] == "failed" and "stopped taking messages" in endpoint.failures["r2"]


def test_an_aborted_request_is_fenced_only_once_its_sender_acknowledges_with_nothing_in_flight(decode):
    """The decode tells the sender; its pages may be reused only after an ``abort-ack`` that says
    ``fenced``; an acknowledgement without it (a write the engine could not end) never fences them, nor
    does one from another request. A request never aborted is not fenced."""
    endpoint, prefill, _, _ = decode
    assert not endpoint.fenced("r1")
    endpoint.abort("r1", "the client went away")
    assert prefill.try_recv()[:2] == ("abort", {"request": "r1", "reason": "the client went away"})
    assert not endpoint.fenced("r1")
    prefill.send("abort-ack", {"request": "r2", "fenced": True})  # another request's: no effect
    endpoint.poll()
    assert not endpoint.fenced("r1")
    prefill.send("abort-ack", {"request": "r1", "fenced": True})
    endpoint.poll()
    assert endpoint.fenced("r1")
    endpoint.forget_fence("r1")
    assert not endpoint.fenced("r1")
    endpoint.abort("r1", "the client went away again")  # (the id again, a new abort)
    prefill.send("abort-ack", {"request": "r1", "fenced": False})
    endpoint.poll()
    assert not endpoint.fenced("r1")
    prefill.send("abort-ack", {"request": "r1", "fenced": True})  # (a write that may land is not ended by a word)
    endpoint.poll()
    assert not endpoint.fenced("r1")


def test_an_aborted_request_is_fenced_once_its_sender_is_gone(decode, monkeypatch):
    endpoint, _, _, _ = decode
    endpoint.abort("r1", "the client went away")
    assert not endpoint.fenced("r1")
    monkeypatch.setattr(endpoint.channels[0], "peer_gone", lambda: True)
    assert endpoint.fenced("r1")


def test_an_abort_after_the_sender_reported_the_request_failed_is_fenced_at_once(decode):
    """The sender reports a failure once its writes ended: the decode's own abort after it needs no
    acknowledgement (an idle prefill may not read it soon). Not after an ``unsafe`` failure."""
    endpoint, prefill, _, _ = decode
    prefill.send("failed", {"request": "r1", "reason": "unsafe: the engine could not end the write"})
    endpoint.poll()
    endpoint.abort("r1", "SGLang's decode concludes it")
    assert not endpoint.fenced("r1")
    endpoint.forget_fence("r1")
    prefill.send("failed", {"request": "r1", "reason": "deadline passed; the write had ended (cancelled or completed) when this was reported"})
    endpoint.poll()
    endpoint.abort("r1", "SGLang's decode concludes it")
    assert endpoint.fenced("r1")


def test_a_write_reported_unsafe_stays_unfenced_whatever_is_reported_after_it(decode):
    """A sender reports a write it could not end (``unsafe``: it may still land); a later report of the same
    request (refused as overload, failed at a queue's deadline) or an acknowledgement of the decode's abort
    must not make its pages reusable."""
    endpoint, prefill, _, _ = decode
    prefill.send("failed", {"request": "r1", "reason": "unsafe: the engine could not end the write"})
    prefill.send("failed", {"request": "r1", "reason": "overload: the prefill's queue is full"})
    endpoint.poll()
    endpoint.abort("r1", "SGLang's decode concludes it")
    assert not endpoint.fenced("r1")
    prefill.send("failed", {"request": "r1", "reason": "deadline passed in the prefill's queue"})
    prefill.send("abort-ack", {"request": "r1", "fenced": True})
    endpoint.poll()
    assert not endpoint.fenced("r1")


def test_a_request_past_its_deadline_is_aborted_at_its_sender_and_fenced_only_once_it_answers(decode):
    """The decode failed a request at its deadline without telling the sender, which
    went on writing into pages given up. Now the sender is told at once, and the pages are fenced
    only by its answer; aborting it again sends nothing more than to those yet to answer."""
    endpoint, prefill, _, published = decode
    endpoint.track([published], time.monotonic() - 1)  # its deadline has passed
    endpoint._checked = 0.0
    endpoint.poll()
    assert endpoint.tracker.state("r1") == "failed"
    kind, header, _ = prefill.try_recv()
    assert (kind, header["request"]) == ("abort", "r1") and "deadline" in header["reason"]
    assert not endpoint.fenced("r1")
    endpoint.abort("r1", "SGLang's decode concludes it")
    assert prefill.try_recv()[0] == "abort"  # not answered yet: told again
    prefill.send("abort-ack", {"request": "r1", "fenced": True})
    endpoint.poll()
    assert endpoint.fenced("r1")
    endpoint.abort("r1", "once more")
    assert prefill.try_recv() is None  # answered: nothing more to send


def test_a_section_note_counts_only_from_the_sender_its_request_was_published_to():
    """With two senders, sender 0's engine could complete sender
    1's request with a note. Each sender names its engine when it pairs; a note from a paired sender's
    engine counts only for that sender's requests (and only as that sender)."""
    pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    side = SideMemory(KVLayout(Attention.MLA, PAGE, (Entry(pool.data_ptr(), PAGE_BYTES, 16),)),
                      req_to_token=table_with({1: [3, 4]}, PAGE, max_ctx=16))
    (mine0, theirs0), (mine1, theirs1) = FakeChannel.pair(), FakeChannel.pair()
    endpoint = DecodeEndpoint(side, FakeEngine(), [mine0, mine1])
    for k, theirs in enumerate((theirs0, theirs1)):
        theirs.send("paired", {"from": f"p{k}", "side": describe_side(side), "engine": f"prefill-{k}"})
    endpoint.poll()
    published = plan_destinations(side, [PreallocatedRequest("r1", row=1, prompt_len=8)]).result()
    endpoint.track(published, time.monotonic() + 30, peer=1)  # r1 is sender 1's
    kv = Section(0, "r1", KV_ROLE, "kv", 0, 1, 2)  # both of r1's pages
    endpoint.engine.inbox.extend([("prefill-0", encode_notification(kv)), ("prefill-1", encode_notification(kv, sender=0))])
    endpoint.poll()
    assert endpoint.tracker.state("r1") == "pending"  # neither counted
    endpoint.engine.inbox.append(("prefill-1", encode_notification(kv)))
    endpoint.poll()
    assert endpoint.tracker.state("r1") == "complete"


@pytest.mark.parametrize("rows, pages, why", [
    ([[3 * PAGE_BYTES, PAGE_BYTES]], 2, "claim 2 KV pages of layer 0, but the run's rows write 1"),
    ([[3 * PAGE_BYTES, 64], [3 * PAGE_BYTES + 64, 64]], 2, "claim 2 KV pages"),  # two rows, one page
])
def test_a_note_that_claims_more_pages_than_its_table_writes_is_refused(decode, rows, pages, why):
    """A note claimed 2 pages while the table wrote 1, and the request completed
    with a page never written."""
    endpoint, prefill, pool, _ = decode
    base = pool.data_ptr()
    _announce(prefill, [[base + a, n] for a, n in rows], pages=pages)
    endpoint.engine.inbox.append(wave_note(7, "p0"))
    assert endpoint.wait() == {"r1": "failed"}
    assert why in endpoint.failures["r1"]
    kind, header, _ = prefill.try_recv()
    assert kind == "wave-done" and why in header["error"]
    assert int(pool.sum()) == 0, "a refused run's bytes were written"


def test_a_note_with_a_negative_page_count_is_refused(decode):
    endpoint, prefill, pool, _ = decode
    _announce(prefill, [[pool.data_ptr() + 3 * PAGE_BYTES, 2 * PAGE_BYTES]], pages=-1)
    assert endpoint.wait() == {"r1": "failed"} and "claims -1 pages" in endpoint.failures["r1"]


def test_a_request_published_after_its_sender_refused_the_pairing_fails_at_once(decode):
    """A refusal read before the request was published (a warm-up polls while it waits for its senders
    to pair) still fails the requests published to that sender, at once and with the reason."""
    endpoint, prefill, _, _ = decode
    prefill.send("refused", {"reason": "page sizes differ"})
    endpoint.poll()
    assert endpoint.tracker.states() == {"r1": "failed"}  # the one published before
    published = plan_destinations(endpoint.side, [PreallocatedRequest("r2", row=1, prompt_len=8)]).result()
    endpoint.track(published, time.monotonic() + 30)
    assert endpoint.tracker.states()["r2"] == "failed"
    assert "refused the pairing: page sizes differ" in endpoint.tracker.failure("r2")


def test_what_a_sender_sent_before_its_connection_dropped_still_completes_its_request(monkeypatch):
    """A prefill that sends its last notification and exits: the decode may see the connection lost before
    it has read that notification (another socket). The loss fails the sender's requests only after
    ``GONE_GRACE_S``; what arrives meanwhile completes them, and what never arrives fails them after."""
    import kvplan.transport.decode_messages as decode_messages

    pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    side = SideMemory(KVLayout(Attention.MLA, PAGE, (Entry(pool.data_ptr(), PAGE_BYTES, 16),)),
                      req_to_token=table_with({1: [3, 4], 2: [5, 6]}, PAGE, max_ctx=16))
    mine, theirs = FakeChannel.pair()
    endpoint = DecodeEndpoint(side, FakeEngine(), mine)
    published = plan_destinations(side, [PreallocatedRequest("r1", row=1, prompt_len=8),
                                         PreallocatedRequest("r2", row=2, prompt_len=8)]).result()
    endpoint.track(published, time.monotonic() + 30)
    monkeypatch.setattr(mine, "peer_gone", lambda: True)
    monkeypatch.setattr(decode_messages, "GONE_GRACE_S", 0.3)
    endpoint.poll()  # the loss is seen; nothing fails yet
    assert endpoint.tracker.state("r1") == endpoint.tracker.state("r2") == "pending"
    endpoint.engine.inbox.append(encode_notification(Section(0, "r1", KV_ROLE, "kv", 0, 1, 2)))  # r1's last note
    endpoint.poll()
    assert endpoint.tracker.state("r1") == "complete"
    deadline = time.monotonic() + 5
    while endpoint.tracker.state("r2") == "pending" and time.monotonic() < deadline:
        endpoint.poll()
        time.sleep(0.01)
    assert endpoint.tracker.state("r2") == "failed"
    assert "the prefill side is gone" in endpoint.tracker.failure("r2")


def test_a_decode_with_staging_takes_senders_up_to_the_shares_its_buffer_was_split_for():
    """A decode endpoint made with ``senders=2`` and one channel takes one more sender later (an SGLang decode
    rank finds its prefill ranks one by one), registering with it its own share of the buffer; a third is
    refused, naming the count, and registers nothing."""
    pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    side = SideMemory(KVLayout(Attention.MLA, PAGE, (Entry(pool.data_ptr(), PAGE_BYTES, 16),)),
                      req_to_token=table_with({1: [3, 4]}, PAGE, max_ctx=16))
    staging = torch.zeros(4096, dtype=torch.uint8)
    first, first_prefill = FakeChannel.pair()
    endpoint = DecodeEndpoint(side, FakeEngine(), first, staging, senders=2)
    endpoint.register(timeout=1)
    second, second_prefill = FakeChannel.pair()
    assert endpoint.add_sender(second, timeout=1) == 1
    shares = [ch.try_recv()[1]["staging"] for ch in (first_prefill, second_prefill)]
    assert shares == [[staging.data_ptr(), 2048], [staging.data_ptr() + 2048, 2048]]
    third, third_prefill = FakeChannel.pair()
    with pytest.raises(LayoutError, match="2 senders"):
        endpoint.add_sender(third, timeout=1)
    assert third_prefill.try_recv() is None and len(endpoint.channels) == 2


def test_a_decode_warm_up_stops_waiting_for_a_sender_whose_process_ended(monkeypatch):
    """The warm-up waits for its senders to pair. A sender whose process ended before its pairing reached
    this side (its control connection closed) will not pair: the warm-up goes on at once instead of at
    its deadline (here a clock that would fail the test long before it)."""
    import kvplan.transport.decode_messages as decode_messages
    from kvplan.transport import decode_warm

    pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    side = SideMemory(KVLayout(Attention.MLA, PAGE, (Entry(pool.data_ptr(), PAGE_BYTES, 16),)),
                      req_to_token=table_with({1: [3, 4]}, PAGE, max_ctx=16))
    mine, _ = FakeChannel.pair()
    endpoint = DecodeEndpoint(side, FakeEngine(), mine, torch.zeros(4096, dtype=torch.uint8))
    endpoint.register(timeout=1)
    monkeypatch.setattr(mine, "peer_gone", lambda: True)  # (its end closed: the process ended)
    monkeypatch.setattr(decode_messages, "GONE_GRACE_S", 0.0)
    looks = iter(range(5000))

    class Clock:  # the warm-up's clock: a thousandth of a second per look, and no more than 5,000 looks
        perf_counter = staticmethod(time.perf_counter)

        @staticmethod
        def monotonic() -> float:
            look = next(looks, None)
            assert look is not None, "the warm-up went on waiting for a sender that is gone"
            return look * 1e-3

    monkeypatch.setattr(decode_warm, "time", Clock)
    assert set(endpoint.warm_up(timeout=1e9)) == {"pairing"}
