"""The reference against the worked examples and vectors of planning.md."""

import numpy as np
import pytest

from kvplan.planner.contract.batch import Attention, Batch, KVLayout
from kvplan.planner.contract.pairing import head_slice
from kvplan.planner.reference.oracle import chunk_end, contiguous_runs, plan_reference, token_pages
from tests.planner.builders import mha_side, last_transfer, table_with

SK, DK = 0x10000000, 0x90000000


def test_worked_example_direct_mode():
    # MHA, 2 layers, item 4096, src pages [3,4,5,9], dst pages [10,11,12,13] (planning.md §8)
    table = table_with({1: [3, 4, 5, 9]}, page_size=1)
    src, dst = mha_side(SK, table=table), mha_side(DK)
    plan = plan_reference(Batch(src, (dst,), (last_transfer(length=4, dst_pages=[10, 11, 12, 13]),)))
    t = plan.transfers[0]
    assert t.runs.tolist() == [[3, 10, 3], [9, 13, 1]]
    expected = []
    for e in range(4):  # K0, K1, V0, V1
        s, d = SK + e * (1 << 24), DK + e * (1 << 24)
        expected += [[s + 3 * 4096, d + 10 * 4096, 12288], [s + 9 * 4096, d + 13 * 4096, 4096]]
    assert t.kv_descs.dtype == np.uint64
    assert t.kv_descs.tolist() == expected
    assert t.last and t.sent and plan.num_descs == 8


def test_partial_last_page_is_included():
    table = table_with({1: [2, 5, 10]}, page_size=4)
    assert token_pages(table, 1, 0, 10, 4).tolist() == [2, 5, 10]


@pytest.mark.parametrize(
    "ts, td, heads, expect",
    [
        (4, 2, 8, [(0, 2, 0), (0, 2, 2), (0, 2, 0), (0, 2, 2)]),  # gather
        (2, 4, 8, [(0, 2, 0), (2, 2, 0), (0, 2, 0), (2, 2, 0)]),  # scatter
        (1, 4, 2, [(0, 1, 0), (0, 1, 0), (1, 1, 0), (1, 1, 0)]),  # GQA replication (PR #30997)
        (4, 4, 8, [(0, 2, 0)] * 4),  # equal
    ],
)
def test_head_slice_vectors(ts, td, heads, expect):
    got = []
    for rank in range(4):
        rs, rd = (rank, 0) if ts > td else (0, rank)
        src = KVLayout(Attention.MHA, 1, (), num_kv_heads=heads, tp_size=ts, tp_rank=rs % ts)
        dst = KVLayout(Attention.MHA, 1, (), num_kv_heads=heads, tp_size=td, tp_rank=rd % td)
        bph = 256
        hs = head_slice(src, dst, max(1, heads // ts) * bph, max(1, heads // td) * bph)
        got.append((hs.src_head, hs.heads_sent, hs.dst_head))
    assert got == expect


def test_chunk_end_rules():
    assert chunk_end(0, 100, 200, 64, last=False) == 64     # trailing partial page waits
    assert chunk_end(64, 120, 200, 64, last=False) == 64    # no full page: 0 pages, not sent
    assert chunk_end(64, 201, 200, 64, last=True) == 200    # the sampled token is never sent
    assert chunk_end(128, 128, 128, 64, last=True) == 128   # last chunk with 0 pages


@pytest.mark.parametrize(
    "src, dst, runs",
    [
        ([10, 11, 20], [5, 6, 7], [[10, 5, 2], [20, 7, 1]]),
        ([5, 4, 3], [1, 2, 3], [[5, 1, 1], [4, 2, 1], [3, 3, 1]]),
        ([1, 1], [2, 3], [[1, 2, 1], [1, 3, 1]]),
        ([], [], []),
    ],
)
def test_contiguous_runs(src, dst, runs):
    assert contiguous_runs(np.array(src, np.int64), np.array(dst, np.int64)).tolist() == runs
