"""The decode side's destination lists: GPU against the reference, wire round trip, pairing."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.errors import AlignmentError, PlanError, UnmappedSlotError
from kvplan.planner.device import eager
from kvplan.planner.device.destinations import PreallocatedRequest, decode_message, plan_destinations
from kvplan.planner.contract.batch import Batch, SideMemory, Transfer
from kvplan.planner.reference.oracle import destination_lists, plan_reference
from tests.planner.device.test_eager import on_device
from tests.planner.reference.test_properties import scenarios
from tests.draws import examples


def _unpack_wire(data: bytes) -> list[list[int]]:
    """docs/planning.md §7, read with struct: ``u32le n | u32le len_0..len_{n-1} | buffers`` of int32."""
    import struct

    (n,) = struct.unpack_from("<I", data, 0)
    sizes = struct.unpack_from(f"<{n}I", data, 4)
    at, out = 4 + 4 * n, []
    for size in sizes:
        out.append(list(struct.unpack_from(f"<{size // 4}i", data, at)))
        at += size
    assert at == len(data), "trailing bytes after the last buffer"
    return out


def side_on(side: SideMemory, device: torch.device) -> SideMemory:
    return side.to(device)


def requests_of(batch: Batch) -> list[PreallocatedRequest]:
    last = {t.request: t for t in batch.transfers if t.last}
    return [PreallocatedRequest(r, t.src_row, t.prompt_len, t.prefix_len, t.aux_dst) for r, t in last.items()]


@settings(max_examples=examples(40), deadline=None)
@given(scenarios(), st.sampled_from([16, 1024]))
def test_destination_lists_match_the_reference(device, case, block):
    _, batch = case
    dst = batch.dsts[0]
    requests = requests_of(batch)
    pending = plan_destinations(side_on(dst, device), requests, block=block)
    published = pending.result()
    messages = pending.messages()
    assert len(messages) == len(requests)
    for r, message in zip(requests, messages):  # decoded here with struct, independently of kvplan's codec
        want = destination_lists(dst, r.row, r.prefix_len, r.prompt_len, r.request)
        assert _unpack_wire(message) == [want.pages.tolist(), *[x.tolist() for x in want.state], [r.aux_index]]
    for r, p in zip(requests, published):
        want = destination_lists(dst, r.row, r.prefix_len, r.prompt_len, r.request)
        assert p.request == r.request
        assert p.lists.pages.dtype == np.int64 and np.array_equal(p.lists.pages, want.pages)
        assert len(p.lists.state) == len(want.state)
        for got, exp in zip(p.lists.state, want.state):
            assert np.array_equal(got, exp)
        lists, aux = decode_message(p.message(), len(dst.state))   # wire round trip
        assert aux == r.aux_index and np.array_equal(lists.pages, want.pages)
        assert all(np.array_equal(x, y) for x, y in zip(lists.state, want.state))
        expect = p.expectation()
        assert expect.kv_pages == len(want.pages) and expect.aux == bool(dst.aux)
        assert expect.components == tuple(c.name for c, ids in zip(dst.state, want.state) if len(ids))


@settings(max_examples=examples(15), deadline=None)
@given(scenarios())
def test_prefill_plan_pairs_with_published_lists(device, case):
    """End to end: lists published by the decode side, through the wire, planned by the prefill side."""
    _, batch = case
    dst = batch.dsts[0]
    published = {p.request: p for p in plan_destinations(side_on(dst, device), requests_of(batch)).result()}
    transfers = []
    for t in batch.transfers:
        lists, aux = decode_message(published[t.request].message(), len(dst.state))
        transfers.append(Transfer(t.request, t.src_row, t.start, t.fill_len, t.prompt_len, t.last, lists.pages,
                                  t.prefix_len, t.aux_src, aux, lists.state, t.dest))
    rebuilt = Batch(batch.src, batch.dsts, tuple(transfers), batch.policy, batch.validate)
    expected = plan_reference(batch)
    plan_reference(rebuilt).assert_equal(expected)
    eager.plan(on_device(rebuilt, device)).result().assert_equal(expected)


def _swa_decode_side(device):
    from tests.planner.reference.test_errors import _swa_sides

    _, dst, _ = _swa_sides(map_dst=False)
    return side_on(dst, device)


def test_unmapped_window_slot_is_rejected(device):
    with pytest.raises(UnmappedSlotError, match="'d1'"):
        plan_destinations(_swa_decode_side(device), [PreallocatedRequest("d1", 2, 4)]).result()


def test_unaligned_prefix_is_rejected(device):
    from tests.planner.builders import mha_side, table_with

    side = side_on(mha_side(0x1000, page_size=4, table=table_with({1: [3, 4]}, 4)), device)
    with pytest.raises(AlignmentError, match="'d2'"):
        plan_destinations(side, [PreallocatedRequest("d2", 1, 8, prefix_len=2)])
    with pytest.raises(PlanError, match="'d3'"):
        plan_destinations(side, [PreallocatedRequest("d3", 0, 8)])
