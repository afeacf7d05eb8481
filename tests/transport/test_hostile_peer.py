"""Hostile peers, fuzzed: random and crafted control messages and engine
notifications go into a decode endpoint and a prefill endpoint. Neither may raise from its poll
loop, and the decode side may write nothing outside what it published.

The messages are built from the real protocol's kinds and keys, with values drawn from what a
broken or malicious peer could send: wrong types, huge and negative numbers, unhashable request
names, tables whose rows point at the pool inside and outside the published pages, notes that
claim more than was written.
"""

import json
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplan.errors import LayoutError
from kvplan.planner.device.destinations import PreallocatedRequest, plan_destinations
from kvplan.planner.contract.batch import Attention, Entry, KVLayout, SideMemory
from kvplan.planner.contract.plan import AUX_ROLE, KV_ROLE
from kvplan.transport.decode import DecodeEndpoint
from kvplan.transport.prefill import PrefillEndpoint
from kvplan.transport.registration import describe_side
from kvplan.transport.waves import credit_note, wave_note
from tests.planner.builders import table_with
from tests.transport.fakes import FakeChannel, FakeEngine

PAGE, PAGE_BYTES, PAGES = 4, 256, 16
PUBLISHED = (3, 4)  # r1's pages

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])

names = st.one_of(st.sampled_from(["r1", "r2", "p0", ""]), st.integers(-3, 3), st.none(),
                  st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))
numbers = st.one_of(st.integers(-4, 4096), st.sampled_from([-(1 << 63), (1 << 64) - 256, 1 << 62, 2 ** 31]),
                    st.floats(allow_nan=True), st.text(max_size=3), st.none())
notes = st.lists(st.one_of(
    st.tuples(names, st.sampled_from([int(KV_ROLE), int(AUX_ROLE), 0, 7]), st.sampled_from(["kv", "aux", "swa", 3]),
              numbers).map(list),
    st.tuples(names, st.just(int(KV_ROLE)), st.just("kv"), numbers, numbers, numbers).map(list),
    numbers), max_size=3)


def _side(pool: torch.Tensor) -> SideMemory:
    return SideMemory(KVLayout(Attention.MLA, PAGE, (Entry(pool.data_ptr(), PAGE_BYTES, PAGES),)),
                      req_to_token=table_with({1: list(PUBLISHED)}, PAGE, max_ctx=16))


@st.composite
def table_rows(draw, base: int) -> bytes:
    """Rows ``(dst, nbytes)``: in the published pages, around them, or anywhere."""
    row = st.tuples(
        st.one_of(st.integers(0, PAGES).map(lambda p: base + p * PAGE_BYTES),
                  st.integers(0, PAGES * PAGE_BYTES).map(lambda b: base + b),
                  st.integers(0, (1 << 64) - 1)),
        st.one_of(st.sampled_from([PAGE_BYTES, 2 * PAGE_BYTES, 16, 0, (1 << 64) - 256, 1 << 63]),
                  st.integers(0, 4096)))
    rows = draw(st.lists(row, max_size=4))
    return np.array(rows, np.uint64).reshape(-1, 2).tobytes()


@st.composite
def decode_messages(draw, base: int) -> tuple[str, dict, list]:
    kind = draw(st.sampled_from(["staged", "staged-plan", "staged-waves", "paired", "failed", "refused",
                                 "abort-ack", "wave-done", "register", "malformed", "what"]))
    header = {}
    if kind == "staged":
        n = draw(st.integers(0, 4))
        header = {"from": draw(names), "alignment": draw(st.one_of(st.sampled_from([16, 256]), numbers)),
                  "requests": draw(st.one_of(st.just([["r1", 0, n]]), st.lists(st.tuples(names, numbers, numbers)
                                                                                .map(list), max_size=2), numbers)),
                  "waves": draw(st.one_of(
                      st.just([[7, 0, 0, n, n * PAGE_BYTES, [["r1", int(KV_ROLE), "kv", 2]]]]),
                      st.lists(st.tuples(numbers, numbers, numbers, numbers, numbers, notes).map(list), max_size=2),
                      numbers))}
        return kind, header, [draw(table_rows(base))]
    if kind in ("staged-plan", "staged-waves"):
        header = {"from": draw(names), "run": draw(numbers), "waves": draw(st.lists(st.lists(numbers, max_size=4),
                                                                                     max_size=2)),
                  "transfers": draw(st.lists(st.lists(st.one_of(names, numbers), max_size=6), max_size=2))}
        if draw(st.booleans()):
            header.pop("waves")
    elif kind == "paired":
        header = {"from": draw(names), "side": draw(st.one_of(st.just(describe_side(_side(torch.zeros(1)))),
                                                              st.dictionaries(st.text(max_size=3), numbers))),
                  "engine": draw(names), "credits": draw(st.sampled_from(["engine", None, 3]))}
    elif kind in ("failed", "abort-ack"):
        header = {"request": draw(names), "reason": draw(st.one_of(st.text(max_size=8), numbers)),
                  "fenced": draw(st.one_of(st.booleans(), numbers))}
    else:
        header = draw(st.dictionaries(st.sampled_from(["request", "wave", "error", "side", "x"]),
                                      st.one_of(names, numbers), max_size=3))
    frames = draw(st.lists(st.binary(max_size=24), max_size=2))
    return kind, header, frames


def engine_notifications(base: int):
    return st.lists(st.one_of(
        st.binary(max_size=32),
        notes.map(lambda n: json.dumps(n).encode()),
        st.tuples(names, numbers).map(lambda x: json.dumps({"from": x[1], "note": x[0]}, default=str).encode()),
        st.sampled_from([wave_note(7, "p0"), wave_note(8, "p0"), credit_note(7), b"{}", b"[]", b"null"]),
    ).map(lambda raw: (None, raw)), max_size=4)


def _hostile_decode():
    pool = torch.zeros(PAGES * PAGE_BYTES, dtype=torch.uint8)
    side = _side(pool)
    mine, theirs = FakeChannel.pair()
    endpoint = DecodeEndpoint(side, FakeEngine(), mine, torch.arange(4096, dtype=torch.int64).to(torch.uint8))
    endpoint.track(_published(side), time.monotonic() + 30)
    return endpoint, theirs, pool


@FUZZ
@given(data=st.data())
def test_a_decode_endpoint_takes_any_message_without_crashing_or_writing_outside_what_it_published(data):
    endpoint, peer, pool = _hostile_decode()
    base = pool.data_ptr()
    for _ in range(data.draw(st.integers(1, 4))):
        for message in data.draw(st.lists(decode_messages(base), min_size=1, max_size=3)):
            peer.other.inbox.append(message)  # as sent, unchecked (FakeChannel.send would round-trip JSON)
        endpoint.engine.inbox.extend(data.draw(engine_notifications(base)))
        endpoint.poll()
    outside = torch.ones(PAGES, dtype=torch.bool)
    outside[list(PUBLISHED)] = False
    assert int(pool.view(PAGES, PAGE_BYTES)[outside].sum()) == 0, "a peer wrote outside what this side published"
    assert endpoint.tracker.state("r1") in ("pending", "complete", "failed")


def _hostile_prefill():
    pool = torch.zeros(PAGES * PAGE_BYTES, dtype=torch.uint8)
    side = _side(pool)
    mine, theirs = FakeChannel.pair()
    return PrefillEndpoint(side, FakeEngine(), mine), theirs, side


_PLANNED: list = []  # request r1's destination lists (they name pages, not addresses: the same for every pool)


def _planned(side: SideMemory):
    """Planned once (the kernels run interpreted on a CPU: each plan costs what many drawn messages do)."""
    if not _PLANNED:
        _PLANNED.append(plan_destinations(side, [PreallocatedRequest("r1", row=1, prompt_len=8)]))
    return _PLANNED[0]


def _good_lists(side: SideMemory) -> bytes:
    return _planned(side).messages()[0]


def _published(side: SideMemory) -> list:
    return _planned(side).result()


@st.composite
def prefill_messages(draw, side: SideMemory) -> tuple[str, dict, list]:
    kind = draw(st.sampled_from(["register", "request", "abort", "wave-done", "paired", "what"]))
    if kind == "register":
        header = {"side": draw(st.one_of(st.just(describe_side(side)), st.dictionaries(st.text(max_size=3), numbers),
                                         numbers)),
                  "staging": draw(st.one_of(st.none(), st.lists(numbers, max_size=3), numbers)),
                  "peer": draw(st.one_of(st.none(), numbers)), "notifies": draw(st.one_of(st.booleans(), numbers))}
    elif kind == "request":
        header = {"request": draw(names), "prompt_len": draw(numbers), "prefix_len": draw(numbers),
                  "plans": draw(st.one_of(st.booleans(), numbers))}
        if draw(st.booleans()):
            header.pop(draw(st.sampled_from(sorted(header))))
    else:
        header = draw(st.dictionaries(st.sampled_from(["request", "reason", "wave", "error"]),
                                      st.one_of(names, numbers), max_size=3))
    good = _good_lists(side)
    frames = draw(st.lists(st.one_of(st.just(good), st.binary(max_size=40)), max_size=2))
    return kind, header, frames


@FUZZ
@given(data=st.data())
def test_a_prefill_endpoint_takes_any_message_without_crashing(data):
    """Only a well-formed registration that cannot pair raises (``LayoutError``, documented); every
    other malformed message is dropped, and a malformed request's lists are answered "failed"."""
    endpoint, peer, side = _hostile_prefill()
    for _ in range(data.draw(st.integers(1, 3))):
        messages = data.draw(st.lists(prefill_messages(side), min_size=1, max_size=3))
        peer.other.inbox.extend(messages)
        try:
            arrived = endpoint.progress()
        except LayoutError:
            assert any(kind == "register" for kind, _, _ in messages), "only a registration may be refused"
            peer.other.inbox.clear()
            continue
        for k, request in arrived:
            assert request in endpoint.peers[k].lists


def test_a_malformed_request_is_answered_failed_not_a_crash():
    endpoint, peer, side = _hostile_prefill()
    peer.send("register", {"side": describe_side(side), "staging": None}, b"meta")
    peer.send("request", {"request": "r9", "prompt_len": 8}, b"\x01\x02")  # no prefix_len, broken lists
    peer.send("request", {"request": ["not", "a", "name"], "prefix_len": 0}, b"")
    assert endpoint.progress() == []
    replies = [peer.try_recv() for _ in range(3)]
    assert replies[0][0] == "paired"
    assert replies[1][0] == "failed" and replies[1][1]["request"] == "r9" and "lists" in replies[1][1]["reason"]
    assert replies[2] is None  # a request with no usable name cannot be answered
    assert "r9" not in endpoint.lists


@pytest.mark.parametrize("kind", ["failed", "abort-ack"])
def test_an_unhashable_request_name_is_dropped_not_a_crash(kind):
    endpoint, peer, _ = _hostile_decode()
    peer.send(kind, {"request": ["r1"], "reason": "x", "fenced": True})
    endpoint.poll()
    assert endpoint.tracker.state("r1") == "pending"
