"""Head-sliced descriptors against vectors written by hand from docs/planning.md §5, not from
pairing.py: TP sizes above the head count on either side, GQA replication, and MLA (never sliced).

Layout used throughout: one MHA layer (entries K, V), page size 2, 16 bytes per head per token, one
request whose page 5 goes to destination page 7.
"""

import numpy as np
import pytest

from kvplan.planner.contract.batch import Attention, Batch, Entry, KVLayout, SideMemory
from kvplan.planner.contract.pairing import Mode, pair_sides
from kvplan.planner.reference.oracle import plan_reference
from tests.planner.builders import last_transfer, table_with

PS, BPH, SRC_PAGE, DST_PAGE = 2, 16, 5, 7
SRC_BASES, DST_BASES = (0x100000, 0x200000), (0x900000, 0xA00000)


def side(bases, heads_per_rank, tp_size, tp_rank, heads=4, table=None, attention=Attention.MHA):
    item = PS * heads_per_rank * BPH
    entries = tuple(Entry(b, item, 16) for b in (bases if attention is Attention.MHA else bases[:1]))
    return SideMemory(KVLayout(attention, PS, entries, num_kv_heads=heads, tp_size=tp_size, tp_rank=tp_rank),
                      req_to_token=table)


def plan_one(src, dst):
    batch = Batch(src.__class__(src.kv, req_to_token=table_with({1: [SRC_PAGE]}, PS)), (dst,),
                  (last_transfer(length=PS, dst_pages=[DST_PAGE]),))
    return plan_reference(batch).descriptors()[0]


def expected(src_item, dst_item, src_head, dst_head, heads_sent):
    """Entry-major, then page, then token: planning.md §5's head-sliced formula, by hand."""
    rows = []
    for sb, db in zip(SRC_BASES, DST_BASES):
        for t in range(PS):
            rows.append((sb + SRC_PAGE * src_item + t * (src_item // PS) + src_head * BPH,
                         db + DST_PAGE * dst_item + t * (dst_item // PS) + dst_head * BPH, heads_sent * BPH))
    return np.array(rows, dtype=np.uint64)


# TP8 -> TP2, 4 KV heads: each source rank holds one head (replicated twice); source ranks 2k and 2k+1
# both hold head k of their decode rank's pair, which lands at destination head k % 2.
@pytest.mark.parametrize("src_rank, dst_head", list(enumerate([0, 0, 1, 1, 0, 0, 1, 1])))
def test_gather_from_more_ranks_than_heads(src_rank, dst_head):
    src = side(SRC_BASES, heads_per_rank=1, tp_size=8, tp_rank=src_rank)
    dst = side(DST_BASES, heads_per_rank=2, tp_size=2, tp_rank=src_rank // 4)
    assert pair_sides(src, dst).mode is Mode.HEAD_SLICED
    assert np.array_equal(plan_one(src, dst), expected(1 * PS * BPH, 2 * PS * BPH, 0, dst_head, 1))


# TP2 -> TP8, 4 KV heads: each destination rank holds one head (replicated twice); decode ranks 2k and
# 2k+1 both take head k, which is head k % 2 of the source rank that holds it.
@pytest.mark.parametrize("dst_rank, src_head", list(enumerate([0, 0, 1, 1, 0, 0, 1, 1])))
def test_scatter_to_more_ranks_than_heads(dst_rank, src_head):
    src = side(SRC_BASES, heads_per_rank=2, tp_size=2, tp_rank=dst_rank // 4)
    dst = side(DST_BASES, heads_per_rank=1, tp_size=8, tp_rank=dst_rank)
    assert np.array_equal(plan_one(src, dst), expected(2 * PS * BPH, 1 * PS * BPH, src_head, 0, 1))


# TP2 -> TP8 with 2 KV heads: every rank holds one head; decode ranks 0-3 replicate head 0, 4-7 head 1.
@pytest.mark.parametrize("dst_rank", range(8))
def test_scatter_with_two_heads_over_eight_ranks(dst_rank):
    src = side(SRC_BASES, heads_per_rank=1, tp_size=2, tp_rank=dst_rank // 4, heads=2)
    dst = side(DST_BASES, heads_per_rank=1, tp_size=8, tp_rank=dst_rank, heads=2)
    assert np.array_equal(plan_one(src, dst), expected(PS * BPH, PS * BPH, 0, 0, 1))


def test_mla_is_never_head_sliced():
    src = side(SRC_BASES, heads_per_rank=1, tp_size=8, tp_rank=3, attention=Attention.MLA)
    dst = side(DST_BASES, heads_per_rank=1, tp_size=2, tp_rank=1, attention=Attention.MLA)
    item = PS * BPH
    assert pair_sides(src, dst).mode is Mode.DIRECT
    want = np.array([[SRC_BASES[0] + SRC_PAGE * item, DST_BASES[0] + DST_PAGE * item, item]], dtype=np.uint64)
    assert np.array_equal(plan_one(src, dst), want)


# A side that names no head count (0: SGLang's decode KVArgs carry none) cannot be head-sliced as it
# is; with the prefill's count (registration.with_model_heads) it plans exactly as if it had named it.
def test_a_side_without_a_head_count_takes_its_peer_s():
    from kvplan.errors import LayoutError
    from kvplan.transport.registration import with_model_heads

    src = side(SRC_BASES, heads_per_rank=2, tp_size=2, tp_rank=0)
    unnamed = side(DST_BASES, heads_per_rank=1, tp_size=4, tp_rank=1, heads=0)
    with pytest.raises(LayoutError, match="not known"):
        pair_sides(src, unnamed)
    dst = with_model_heads(unnamed, src.kv.num_kv_heads)
    assert dst.kv.num_kv_heads == 4 and with_model_heads(dst, 8).kv.num_kv_heads == 4  # a named count stays
    assert np.array_equal(plan_one(src, dst), plan_one(src, side(DST_BASES, 1, 4, 1)))
    assert np.array_equal(plan_one(src, dst), expected(2 * PS * BPH, 1 * PS * BPH, 1, 0, 1))
