"""The reference and the device path refuse the same inputs, with kvplan's own errors."""

import numpy as np
import pytest
import torch

from kvplan.errors import AllocatorInvariantError, InputError
from kvplan.planner.device import eager
from kvplan.planner.device.destinations import PreallocatedRequest, plan_destinations
from kvplan.planner.contract.batch import Batch, Transfer
from kvplan.planner.reference.oracle import destination_lists, plan_reference
from tests.planner.builders import last_transfer, mha_side, table_with

GOOD = table_with({1: [5, 6]}, 4, max_ctx=16)
BAD_TABLES = {
    "int64": GOOD.astype(np.int64),
    "float32": GOOD.astype(np.float32),
    "list": GOOD.tolist(),
    "1-D": GOOD[1],
    "column-major": np.asfortranarray(GOOD),
    "column-major tensor": torch.from_numpy(GOOD).t().contiguous().t(),
}


def batch_with(table):
    src = mha_side(0x1000_0000, page_size=4, table=table)
    return Batch(src, (mha_side(0x9000_0000, page_size=4),), (last_transfer(length=8, dst_pages=[3, 4]),))


@pytest.mark.parametrize("name", list(BAD_TABLES))
def test_a_table_one_path_would_refuse_is_refused_by_both(name):
    batch = batch_with(BAD_TABLES[name])
    with pytest.raises(InputError, match="req_to_token"):
        plan_reference(batch)
    with pytest.raises(InputError, match="req_to_token"):
        eager.plan(batch).result()
    side = mha_side(0x9000_0000, page_size=4, table=BAD_TABLES[name])
    with pytest.raises(InputError, match="req_to_token"):
        destination_lists(side, 1, 0, 8)
    with pytest.raises(InputError, match="req_to_token"):
        plan_destinations(side, [PreallocatedRequest("r1", 1, 8)])


def test_the_good_table_plans_on_both_paths(device):
    batch = batch_with(GOOD)
    eager.plan(batch.to(device)).result().assert_equal(plan_reference(batch))


def test_an_unknown_policy_and_float_pages_are_input_errors_naming_what_is_wrong():
    with pytest.raises(InputError, match="policy must be one of"):
        Batch(batch_with(GOOD).src, (), (), policy="lenient")
    with pytest.raises(InputError) as raised:
        Transfer("r9", 1, 0, 9, 8, True, np.array([3.0, 4.0]))
    assert raised.value.request == "r9" and "integer" in str(raised.value)


def test_an_unallocated_row_is_named_as_such_on_both_paths(device):
    table = table_with({1: [5, 6]}, 4, max_ctx=16)  # row 2 was never allocated: all zeros
    src = mha_side(0x1000_0000, page_size=4, table=table)
    batch = Batch(src, (mha_side(0x9000_0000, page_size=4),), (last_transfer("r2", row=2, length=8, dst_pages=[3, 4]),))
    with pytest.raises(AllocatorInvariantError, match="tokens 1 to 7 are all 0: the row is unallocated") as host_err:
        plan_reference(batch)
    with pytest.raises(AllocatorInvariantError, match="are all 0: the row is unallocated") as device_err:
        eager.plan(batch.to(device)).result()
    assert host_err.value.request == device_err.value.request == "r2"
