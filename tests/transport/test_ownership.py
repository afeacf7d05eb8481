"""A request goes only to the decode endpoints that published it, in parts that do not
clash. A second publisher of a request published once, a count that disagrees, two publishers of one rank's
part, or lists naming pages outside the publisher's pools: the request is refused, every publisher is told
why, and nothing of it is sent; the other requests are untouched."""

import torch

from kvplan.planner.device.destinations import PreallocatedRequest, plan_destinations
from kvplan.planner.contract.batch import Attention, Entry, KVLayout, SideMemory
from kvplan.transport.prefill import Chunk, PrefillEndpoint
from kvplan.transport.registration import describe_side
from tests.planner.builders import table_with
from tests.transport.fakes import FakeChannel, FakeEngine

PAGE, PAGE_BYTES, HEADS = 4, 256, 2


def _mha(pool, rows, pages=16, tp_size=1, tp_rank=0):
    item = PAGE_BYTES // tp_size
    entries = (Entry(pool.data_ptr(), item, pages), Entry(pool.data_ptr() + pages * item, item, pages))
    return SideMemory(KVLayout(Attention.MHA, PAGE, entries, num_kv_heads=HEADS, tp_size=tp_size, tp_rank=tp_rank),
                      req_to_token=table_with(rows, PAGE, max_ctx=16))


def _prefill_with(decode_sides):
    """A prefill endpoint paired with one fake decode endpoint per side; its channels' far ends."""
    src_pool = torch.zeros(2 * 16 * PAGE_BYTES, dtype=torch.uint8)
    pairs = [FakeChannel.pair() for _ in decode_sides]
    prefill = PrefillEndpoint(_mha(src_pool, {1: [5, 9], 2: [10, 11]}), FakeEngine(), [m for m, _ in pairs])
    for (_, theirs), decode_side in zip(pairs, decode_sides):
        theirs.send("register", {"side": describe_side(decode_side), "staging": None}, b"meta")
    prefill.accept(timeout=1)
    return prefill, [t for _, t in pairs], src_pool


def _publish(theirs, decode_side, request, row, **header):
    message = plan_destinations(decode_side, [PreallocatedRequest(request, row, 8)]).messages()[0]
    theirs.send("request", {"request": request, "prompt_len": 8, "prefix_len": 0, **header}, message)


def _failed(theirs):
    out = {}
    while (msg := theirs.try_recv()) is not None:
        if msg[0] == "failed":
            out[msg[1]["request"]] = msg[1]["reason"]
    return out


def test_a_request_published_by_a_second_endpoint_goes_to_neither_and_both_are_told():
    """Any peer that published another's request id received that request's KV."""
    dst = torch.zeros(2 * 16 * PAGE_BYTES, dtype=torch.uint8)
    victim, thief = _mha(dst, {1: [3, 4], 2: [6, 7]}), _mha(dst, {1: [12, 13]})
    prefill, (to_victim, to_thief), _pool = _prefill_with([victim, thief])
    _publish(to_victim, victim, "r1", 1)
    _publish(to_victim, victim, "r2", 2)
    prefill.progress()
    _publish(to_thief, thief, "r1", 1)
    prefill.progress()
    assert "r1" not in prefill.peers[0].lists and "r1" not in prefill.peers[1].lists
    assert "more than the 1" in _failed(to_victim)["r1"] and "more than the 1" in _failed(to_thief)["r1"]
    assert prefill.send([prefill.transfer(Chunk("r2", 2, 0, 9, 8, True))], mode="direct", timeout=5) == {"r2": None}
    assert len(prefill.engine.posted) == 1  # r2 alone, to its own publisher


def test_an_overstated_publisher_count_fails_the_request_rather_than_holding_it_back():
    """A peer that claimed 1,024 publishers for another's request stopped it from ever going."""
    dst = torch.zeros(2 * 16 * PAGE_BYTES, dtype=torch.uint8)
    victim, liar = _mha(dst, {1: [3, 4]}), _mha(dst, {1: [12, 13]})
    prefill, (to_victim, to_liar), _pool = _prefill_with([victim, liar])
    _publish(to_liar, liar, "r1", 1, publishers=1024)
    prefill.progress()
    _publish(to_victim, victim, "r1", 1)
    prefill.progress()
    assert "one of 1024" in _failed(to_victim)["r1"] and "r1" in _failed(to_liar)
    assert not any("r1" in p.lists for p in prefill.peers)


def test_two_publishers_of_one_rank_s_part_are_refused_and_two_ranks_parts_are_taken():
    dst = torch.zeros(2 * 16 * PAGE_BYTES, dtype=torch.uint8)
    rank0, rank1, copy0 = (_mha(dst, {1: [3, 4]}, tp_size=2, tp_rank=0), _mha(dst, {1: [6, 7]}, tp_size=2, tp_rank=1),
                           _mha(dst, {1: [12, 13]}, tp_size=2, tp_rank=0))
    prefill, (to0, to1, to_copy), _pool = _prefill_with([rank0, rank1, copy0])
    _publish(to0, rank0, "r1", 1, publishers=2)
    _publish(to1, rank1, "r1", 1, publishers=2)
    prefill.progress()
    assert prefill.published_by_all("r1")
    _publish(to0, rank0, "r2", 1, publishers=2)
    _publish(to_copy, copy0, "r2", 1, publishers=2)
    prefill.progress()
    assert "the same part of it (TP rank 0 of 2)" in _failed(to_copy)["r2"] and "r2" in _failed(to0)
    assert not any("r2" in p.lists for p in prefill.peers) and "r1" in prefill.peers[1].lists


def test_lists_naming_pages_outside_the_publisher_s_pools_fail_that_request_alone():
    """A page of 2**30 in one request's lists refused the whole batch it joined."""
    dst = torch.zeros(2 * 16 * PAGE_BYTES, dtype=torch.uint8)
    decode_side = _mha(dst, {1: [3, 4], 2: [6, 7]})
    prefill, (theirs,), _pool = _prefill_with([decode_side])
    huge = _mha(dst, {3: [1 << 20, 5]}, pages=(1 << 20) + 1)  # (a description only: lists that name page 2**20)
    _publish(theirs, huge, "bad", 3)
    _publish(theirs, decode_side, "r1", 1)
    _publish(theirs, decode_side, "r2", 2)
    prefill.progress()
    assert "outside the pools" in _failed(theirs)["bad"] and "bad" not in prefill.peers[0].lists
    batch = [prefill.transfer(Chunk(r, row, 0, 9, 8, True)) for r, row in (("r1", 1), ("r2", 2))]
    assert prefill.send(batch, mode="direct", timeout=5) == {"r1": None, "r2": None}


def test_an_endpoint_that_publishes_past_its_bound_has_the_excess_refused_and_named():
    """200,000 lists published and never sent grew the prefill by 96 MiB, without a bound. Now
    each decode endpoint holds at most ``max_published`` here; one more fails by name, nothing of it is
    kept, and the bound is counted."""
    dst = torch.zeros(2 * 16 * PAGE_BYTES, dtype=torch.uint8)
    decode = _mha(dst, {1: [3, 4], 2: [6, 7], 3: [8, 9]})
    src_pool = torch.zeros(2 * 16 * PAGE_BYTES, dtype=torch.uint8)
    mine, theirs = FakeChannel.pair()
    prefill = PrefillEndpoint(_mha(src_pool, {1: [5, 9]}), FakeEngine(), [mine], max_published=2)
    theirs.send("register", {"side": describe_side(decode), "staging": None}, b"meta")
    prefill.accept(timeout=1)
    for request, row in (("r1", 1), ("r2", 2), ("r3", 3)):
        _publish(theirs, decode, request, row)
    assert sorted(r for _, r in prefill.progress()) == ["r1", "r2"]
    assert sorted(prefill.peers[0].lists) == ["r1", "r2"]
    assert "max_published" in _failed(theirs)["r3"]
    assert prefill.stats()["bounds_hit"]["published"] == 1
    _publish(theirs, decode, "r1", 1)  # (published again: not one more)
    prefill.progress()
    assert "r1" in prefill.peers[0].lists and _failed(theirs) == {}


def test_a_write_that_cannot_be_ended_to_a_decode_that_is_gone_stays_unsafe(monkeypatch):
    """A write that could not be ended to a peer that was gone was reported "the decode side is
    gone" (the ``unsafe`` reason replaced) and later acknowledged ``fenced: true``. The reason now starts
    ``unsafe`` and names the loss, the decode is told so, and the request is never acknowledged fenced."""
    monkeypatch.setenv("KVPLAN_DRAIN_S", "0.05")
    dst = torch.zeros(2 * 16 * PAGE_BYTES, dtype=torch.uint8)
    decode = _mha(dst, {1: [3, 4]})
    src_pool = torch.zeros(2 * 16 * PAGE_BYTES, dtype=torch.uint8)
    mine, theirs = FakeChannel.pair()
    prefill = PrefillEndpoint(_mha(src_pool, {1: [5, 9]}), FakeEngine(stuck=True, abort_after=None), [mine])
    theirs.send("register", {"side": describe_side(decode), "staging": None}, b"meta")
    prefill.accept(timeout=1)
    _publish(theirs, decode, "r1", 1)
    prefill.progress()
    posted = []
    prefill.engine.on_post = lambda *_: posted.append(1) or setattr(mine, "peer_gone", lambda: True)  # it dies
    result = prefill.send([prefill.transfer(Chunk("r1", 1, 0, 9, 8, True))], mode="direct", timeout=0.05)
    assert posted and result["r1"].startswith("unsafe") and "the decode side is gone" in result["r1"], result
    assert _failed(theirs)["r1"].startswith("unsafe")
    assert "r1" in prefill.unsafe
