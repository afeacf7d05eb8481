"""Destination claims (planning.md §6.1): two writes to one destination item refuse the batch.

The host rule on hand-made claims; then random batches with one injected overlap (KV page, state
item, aux row, a page listed twice), where the reference and the device planner must raise the same
:class:`DestinationOverlapError` naming both requests; and the device's claim bitmap must be all
zero again after every plan.
"""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvplan.errors import DestinationOverlapError
from kvplan.planner.device import eager
from kvplan.planner.contract.claims import Claims, check_claims, overlaps
from kvplan.planner.device.isolate import plan_each, without
from kvplan.planner.contract.batch import Batch
from kvplan.planner.reference.oracle import plan_reference
from tests.planner.builders import last_transfer, mha_side, table_with
from tests.planner.reference.test_properties import scenarios
from tests.draws import examples


def claims(request, dest=0, kv=(), state=(), aux=None):
    return Claims(request, dest, np.array(kv, np.int64), tuple(np.array(s, np.int64) for s in state), aux)


def test_two_requests_sharing_a_page_name_both():
    with pytest.raises(DestinationOverlapError) as raised:
        check_claims([claims("a", kv=[3, 4, 5]), claims("b", kv=[9, 4])])
    err = raised.value
    assert (err.request, err.other) == ("b", "a")
    assert "destination 0 KV page 4 (position 1)" in str(err) and "'a' (position 1)" in str(err)


def test_one_request_listing_a_page_twice_is_named_alone():
    with pytest.raises(DestinationOverlapError) as raised:
        check_claims([claims("a", kv=[3, 7, 3])])
    assert (raised.value.request, raised.value.other) == ("a", "a")
    assert "written twice by this request (positions 0 and 2" in str(raised.value)


def test_state_items_and_aux_rows_are_claims_too():
    [err] = overlaps([claims("a", state=[[5]], aux=2), claims("b", state=[[6]], aux=2)], ["mamba"])
    assert (err.request, err.other) == ("b", "a") and "aux row 2" in str(err)
    [err] = overlaps([claims("a", state=[[5]]), claims("b", state=[[5]])], ["mamba"])
    assert "destination 0 mamba item 5" in str(err)


def test_one_id_in_different_lists_or_destinations_is_no_overlap():
    assert overlaps([claims("a", kv=[5], state=[[5]], aux=5), claims("b", dest=1, kv=[5], state=[[5]], aux=5)]) == []


def test_the_first_item_claimed_again_in_batch_order_is_reported_once_per_pair():
    found = overlaps([claims("a", kv=[1, 2]), claims("b", kv=[2, 1]), claims("c", kv=[8]), claims("d", kv=[8, 1])])
    assert [(e.request, e.other) for e in found] == [("b", "a"), ("d", "c"), ("d", "a")]
    assert "KV page 2" in str(found[0])


# -- the reference and the device planner on random batches -------------------------------------

def _overlapping(batch: Batch, kind: str, pick: int):
    """The batch with one destination item claimed twice: ``(batch, later request, earlier request)``."""
    plan = plan_reference(batch)
    sent = [(i, t, tp) for i, (t, tp) in enumerate(zip(batch.transfers, plan.transfers))]
    if kind == "twice":
        cands = [(i, t, tp) for i, t, tp in sent if len(tp.dst_pages) >= 2]
        if not cands:
            return None
        _, t, tp = cands[pick % len(cands)]
        pages = t.dst_pages.copy()
        pages[np.flatnonzero(pages == tp.dst_pages[1])] = tp.dst_pages[0]
        return _with(batch, t.request, dst_pages=pages), t.request, t.request
    pairs = [(a, b) for a in sent for b in sent if a[0] < b[0] and a[1].request != b[1].request]
    if kind == "kv":
        pairs = [(a, b) for a, b in pairs if len(a[2].dst_pages) and len(b[2].dst_pages)]
    elif kind == "aux":
        pairs = [(a, b) for a, b in pairs if len(a[2].aux_descs) and len(b[2].aux_descs)]
    else:
        pairs = [(a, b) for a, b in pairs if a[2].state and b[2].state and len(a[2].state[0].dst_list)
                 and len(b[2].state[0].dst_list)]
    if not pairs:
        return None
    (_, ta, pa), (_, tb, pb) = pairs[pick % len(pairs)]
    if kind == "kv":
        pages = tb.dst_pages.copy()
        pages[np.flatnonzero(pages == pb.dst_pages[-1])] = pa.dst_pages[0]
        return _with(batch, tb.request, dst_pages=pages), tb.request, ta.request
    if kind == "aux":
        return _with(batch, tb.request, aux_dst=ta.aux_dst), tb.request, ta.request
    first = tb.dst_state[0].copy()
    first[np.flatnonzero(first == pb.state[0].dst_list[-1])[-1:]] = pa.state[0].dst_list[0]
    return _with(batch, tb.request, dst_state=(first, *tb.dst_state[1:])), tb.request, ta.request


def _with(batch: Batch, request, **changes) -> Batch:
    return replace(batch, transfers=tuple(replace(t, **changes) if t.request == request else t
                                          for t in batch.transfers))


@settings(max_examples=examples(30), deadline=None)
@given(scenarios(), st.sampled_from(["kv", "aux", "state", "twice"]), st.integers(0, 50))
def test_an_injected_overlap_raises_the_same_error_on_both_paths(device, case, kind, pick):
    made = _overlapping(case[1], kind, pick)
    assume(made is not None)
    batch, later, earlier = made
    with pytest.raises(DestinationOverlapError) as by_reference:
        plan_reference(batch)
    assert (by_reference.value.request, by_reference.value.other) == (later, earlier)
    with pytest.raises(DestinationOverlapError) as on_device:
        eager.plan(batch.to(device)).check()
    assert str(on_device.value) == str(by_reference.value)


@settings(max_examples=examples(10), deadline=None)
@given(scenarios())
def test_the_claim_bitmap_is_clear_after_every_plan(device, case):
    """A bit left set would refuse the next good batch planned in the same buffers."""
    pending = eager.plan(case[1].to(device))
    pending.check()
    assert int(pending._slot.buffers.claimed.count_nonzero()) == 0


def test_per_request_refusal_refuses_both_claimants(device):
    table = table_with({1: [5, 6], 2: [1, 2], 3: [9, 10]}, 4, max_ctx=16)
    side = mha_side(0x1000_0000, page_size=4, table=table)
    batch = Batch(side, (mha_side(0x9000_0000, page_size=4),), (
        last_transfer("a", row=1, length=8, dst_pages=[3, 4]),
        last_transfer("b", row=2, length=8, dst_pages=[7, 4]),
        last_transfer("c", row=3, length=8, dst_pages=[11, 12])))
    pending, refused = plan_each(batch.to(device))
    assert set(refused) == {"a", "b"} and all(isinstance(e, DestinationOverlapError) for e in refused.values())
    pending.result().assert_equal(plan_reference(without(batch, refused)))
