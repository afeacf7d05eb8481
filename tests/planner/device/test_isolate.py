"""plan_each: every bad request is reported with its own error, and the rest plans as if alone."""

import pytest

from kvplan.errors import AllocatorInvariantError, PlanError, PoolBoundsError
from kvplan.planner.device.isolate import plan_each, refused_requests, without
from kvplan.planner.contract.batch import Batch
from kvplan.planner.reference.oracle import plan_reference
from tests.planner.builders import last_transfer, mha_side, table_with


def batch_of(*transfers):
    table = table_with({1: [5, 6], 3: [1, 2]}, 4, max_ctx=16)  # row 2 was never allocated
    return Batch(mha_side(0x1000_0000, page_size=4, table=table), (mha_side(0x9000_0000, page_size=4),), transfers)


def test_every_bad_request_is_refused_with_its_error_and_the_rest_plans(device):
    good = last_transfer("ok", row=1, length=8, dst_pages=[3, 4])
    also_good = last_transfer("ok2", row=3, length=8, dst_pages=[7, 8])
    unallocated = last_transfer("zeros", row=2, length=8, dst_pages=[5, 6])
    outside = last_transfer("outside", row=3, length=8, dst_pages=[9, 99])  # page 99 of a 64-page pool
    batch = batch_of(good, unallocated, also_good, outside)
    pending, refused = plan_each(batch.to(device))
    assert set(refused) == {"zeros", "outside"}
    assert isinstance(refused["zeros"], AllocatorInvariantError) and refused["zeros"].request == "zeros"
    assert isinstance(refused["outside"], PoolBoundsError) and refused["outside"].request == "outside"
    pending.result().assert_equal(plan_reference(without(batch, refused)))


def test_a_good_batch_plans_whole_and_refused_requests_agree_with_the_reference():
    batch = batch_of(last_transfer("ok", row=1, length=8, dst_pages=[3, 4]))
    assert refused_requests(batch) == {}
    with pytest.raises(PlanError):
        plan_reference(batch_of(last_transfer("zeros", row=2, length=8, dst_pages=[5, 6])))
