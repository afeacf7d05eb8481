"""The receiver writes a peer's staged wave only inside what it published for the wave's requests."""

import numpy as np
import pytest

from kvplan.errors import PeerError
from kvplan.planner.contract.batch import Attention, Entry, KVLayout, SideMemory, StateComponent, StateKind
from kvplan.planner.contract.plan import DestinationLists
from kvplan.transport.landing import LandingGuard, merge_ranges

KV = (Entry(0x10000, 256, 64), Entry(0x90000, 256, 64))  # two KV entries, 64 pages of 256 bytes
RING = StateComponent(StateKind.SWA_RING, (Entry(0x200000, 32, 100),), window=4, ring_size=8)
SIDE = SideMemory(KVLayout(Attention.MLA, 16, KV), (RING,), aux=(Entry(0x300000, 64, 10),))


def guard_with(request="r1", pages=(3, 4, 9), ring=(5, 6), aux=2):
    guard = LandingGuard(SIDE)
    guard.publish(request, DestinationLists(np.array(pages), (np.array(ring),)), aux)
    return guard


def test_rows_inside_the_published_pages_slots_and_aux_pass():
    guard = guard_with()
    rows = np.array([[0x10000 + 3 * 256, 512],      # pages 3..4 of entry 0, one run
                     [0x90000 + 9 * 256 + 64, 64],  # part of page 9 of entry 1 (a head slice)
                     [0x200000 + 5 * 32, 64],       # ring rows 5..6
                     [0x300000 + 2 * 64, 64]], np.uint64)
    guard.check(["r1"], rows)


@pytest.mark.parametrize("row, why", [
    ((0x10000 + 5 * 256, 256), "an unpublished page"),
    ((0x10000 + 4 * 256, 512), "a run past the last published page of the stretch"),
    ((0x200000 + 7 * 32, 32), "an unpublished ring row"),
    ((0x300000 + 3 * 64, 64), "another aux row"),
    ((0x10000 + 3 * 256 - 8, 16), "bytes just before a published page"),
    ((0x10000 + 3 * 256, 0), "an empty row"),
    ((0x8, 8), "memory of no entry at all"),
])
def test_a_row_outside_what_was_published_is_refused(row, why):
    guard = guard_with()
    with pytest.raises(PeerError, match="outside what this side published"):
        guard.check(["r1"], np.array([row], np.uint64))
    with pytest.raises(PeerError, match="outside what this side published"):
        guard.check_spans([("r1", 0, 1)], np.array([row], np.uint64))


def test_a_wave_may_only_use_the_ranges_of_the_requests_it_names():
    guard = guard_with()
    guard.publish("r2", DestinationLists(np.array([20]), (np.array([0]),)), 5)
    other = np.array([[0x10000 + 20 * 256, 256]], np.uint64)
    guard.check(["r2"], other)
    with pytest.raises(PeerError):
        guard.check(["r1"], other)
    guard.check(["r1", "r2"], np.concatenate([other, [[0x10000 + 3 * 256, 256]]]).astype(np.uint64))


def test_unknown_and_forgotten_requests_are_refused():
    guard = guard_with()
    with pytest.raises(PeerError, match="not published"):
        guard.check(["nobody"], np.zeros((0, 2), np.uint64))
    guard.forget("r1")
    assert len(guard) == 0
    with pytest.raises(PeerError, match="not published"):
        guard.check(["r1"], np.array([[0x10000 + 3 * 256, 256]], np.uint64))


def test_merge_ranges_joins_touching_and_overlapping_ranges():
    rng = np.random.default_rng(0)
    starts = rng.integers(0, 1000, 200).astype(np.uint64)
    ends = starts + rng.integers(1, 20, 200).astype(np.uint64)
    s, e = merge_ranges(starts, ends)
    covered = np.zeros(1100, bool)
    for a, b in zip(starts, ends):
        covered[a:b] = True
    merged = np.zeros(1100, bool)
    for a, b in zip(s, e):
        merged[a:b] = True
    assert np.array_equal(covered, merged) and (s[1:] > e[:-1]).all()


def test_span_checks_keep_each_requests_rows_to_its_own_ranges():
    guard = LandingGuard(SIDE)
    guard.publish("a", DestinationLists(np.array([1, 2]), (np.array([0]),)), aux_index=0)
    guard.publish("b", DestinationLists(np.array([5]), (np.array([1]),)), aux_index=1)
    rows = np.array([[0x10000 + 1 * 256, 512], [0x10000 + 5 * 256, 256]], np.uint64)
    guard.check_spans([("a", 0, 1), ("b", 1, 2)], rows)
    with pytest.raises(PeerError, match="row 1 .* request 'a'"):  # b's page, in a's rows
        guard.check_spans([("a", 0, 2), ("b", 2, 2)], rows)
    with pytest.raises(PeerError, match="row 0 .* request 'b'"):
        guard.check_spans([("b", 0, 1), ("a", 1, 2)], rows)
    with pytest.raises(PeerError, match="has not published"):
        guard.check_spans([("c", 0, 2)], rows)


@pytest.mark.parametrize("check", ["check", "check_spans"])
def test_a_size_that_wraps_past_2_64_is_refused(check):
    """``dst + size`` in uint64 wrapped a size near 2**64 back inside a published page,
    so 256 bytes from before it were let through."""
    guard = guard_with()
    rows = np.array([[0x10000 + 4 * 256, (1 << 64) - 256]], np.uint64)  # starts in published page 4
    with pytest.raises(PeerError, match="outside what this side published"):
        guard.check(["r1"], rows) if check == "check" else guard.check_spans([("r1", 0, 1)], rows)
