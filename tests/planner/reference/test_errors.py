"""Bad input gets an error that names the request; SGLang's leniency only under ``truncate``.

Also one regression test per bug in SGLang's record that planning.md cites.
"""

import logging

import numpy as np
import pytest

from kvplan.compat.sglang import group_concurrent_contiguous
from kvplan.errors import (
    AlignmentError,
    AllocatorInvariantError,
    LayoutError,
    LengthMismatchError,
    PoolBoundsError,
    UnmappedSlotError,
)
from kvplan.planner.contract.batch import Batch, Entry, Policy, StateComponent, StateKind
from kvplan.planner.reference.oracle import destination_lists, plan_reference
from kvplan.tools.verify import AddressSpace, execute
from tests.planner.builders import entries, last_transfer, mha_side, swa, table_with

SK, DK = 0x10000000, 0x90000000


def plan(src, dst, *transfers, policy=Policy.STRICT):
    return plan_reference(Batch(src, (dst,), transfers, policy=policy))


def test_unaligned_chunk_start_is_rejected():
    table = table_with({1: [3, 4]}, page_size=4)
    src, dst = mha_side(SK, page_size=4, table=table), mha_side(DK, page_size=4)
    with pytest.raises(AlignmentError, match="'r1'.*start 2"):
        plan(src, dst, last_transfer(length=8, start=2, dst_pages=[1, 2]))


def test_page_outside_the_pool_is_rejected():
    table = table_with({1: [3, 70]}, page_size=1)  # pool has 64 pages
    src, dst = mha_side(SK, table=table), mha_side(DK)
    with pytest.raises(PoolBoundsError, match="'r1'.*70"):
        plan(src, dst, last_transfer(length=2, dst_pages=[1, 2]))
    table = table_with({1: [3, 4]}, page_size=1)
    with pytest.raises(PoolBoundsError, match="destination"):
        plan(mha_side(SK, table=table), dst, last_transfer(length=2, dst_pages=[0, 1]))


def test_broken_allocator_invariant_is_rejected():
    table = table_with({1: [3, 4]}, page_size=4)
    table[1, 5] = 99  # second page's slot no longer consecutive
    src, dst = mha_side(SK, page_size=4, table=table), mha_side(DK, page_size=4)
    with pytest.raises(AllocatorInvariantError, match="'r1'.*token 5"):
        plan(src, dst, last_transfer(length=8, dst_pages=[1, 2]))
    # without validation, SGLang's behaviour: page ids from the first slot of each page
    lenient = plan_reference(Batch(src, (dst,), (last_transfer(length=8, dst_pages=[1, 2]),), validate=False))
    assert lenient.transfers[0].src_pages.tolist() == [3, 4]


def test_short_destination_list_strict_and_truncate(caplog):
    table = table_with({1: [3, 4, 5]}, page_size=1)
    src, dst = mha_side(SK, table=table), mha_side(DK)
    t = last_transfer(length=3, dst_pages=[7, 8])
    with pytest.raises(LengthMismatchError, match="'r1'.*3 source pages, 2 destination"):
        plan(src, dst, t)
    with caplog.at_level(logging.WARNING, logger="kvplan"):
        p = plan(src, dst, t, policy=Policy.TRUNCATE)
    assert p.transfers[0].src_pages.tolist() == [3, 4] and "truncating" in caplog.text


def test_scheduler_flag_disagreeing_with_pages_is_rejected():
    table = table_with({1: [3, 4, 5]}, page_size=1)
    src, dst = mha_side(SK, table=table), mha_side(DK)
    with pytest.raises(LengthMismatchError, match="last=True"):
        plan(src, dst, last_transfer(length=3, dst_pages=[7, 8, 9, 10]))


def test_item_length_mismatch_names_the_entry():
    table = table_with({1: [3]}, page_size=1)
    with pytest.raises(LayoutError, match="entry 0"):
        plan(mha_side(SK, table=table), mha_side(DK, item_len=2048), last_transfer(length=1, dst_pages=[1]))


def test_a_page_size_mismatch_pairs_only_with_equal_bytes_per_token_in_kv_and_paged_state():
    with pytest.raises(LayoutError, match="KV entry 0: bytes per token differ"):  # 4096 per page on both sides
        plan(mha_side(SK, table=table_with({}, 1)), mha_side(DK, page_size=2), last_transfer(length=1, dst_pages=[1]))
    with pytest.raises(LayoutError, match=r"state component 0 \(swa\) entry 0: bytes per token differ \(source 512/1"):
        plan(mha_side(SK, table=table_with({}, 1), state=[swa(SK + (1 << 30), np.zeros(64, np.int64), 2)]),
             mha_side(DK, page_size=2, item_len=8192, state=[swa(DK + (1 << 30), np.zeros(64, np.int64), 2)]),
             last_transfer(length=1, dst_pages=[1]))


def _swa_sides(page_size=1, window=2, length=4, map_dst=True):
    pages = [3, 4, 5, 6][: -(-length // page_size)]
    table = table_with({1: pages}, page_size)
    full_to_swa = np.zeros(64 * page_size, np.int64)
    for k, p in enumerate(pages):
        full_to_swa[p * page_size : (p + 1) * page_size] = (20 + k) * page_size + np.arange(page_size)
    src = mha_side(SK, page_size=page_size, table=table, state=[swa(SK + (1 << 30), full_to_swa, window)])
    dst_table = table_with({2: [40, 41, 42, 43][: len(pages)]}, page_size)
    dst_map = np.zeros(64 * page_size, np.int64)
    if map_dst:
        for k, p in enumerate([40, 41, 42, 43][: len(pages)]):
            dst_map[p * page_size : (p + 1) * page_size] = (30 + k) * page_size + np.arange(page_size)
    dst = mha_side(DK, page_size=page_size, table=dst_table, state=[swa(DK + (1 << 30), dst_map, window)])
    return src, dst, full_to_swa


def test_unmapped_swa_slot_strict_and_truncate(caplog):
    src, dst, full_to_swa = _swa_sides()
    full_to_swa[5] = 0  # token 2 of the window lost its SWA slot
    dl = destination_lists(dst, 2, 0, 4)
    t = last_transfer(length=4, dst_pages=dl.pages, dst_state=dl.state)
    with pytest.raises(UnmappedSlotError, match="'r1'.*token 2"):
        plan(src, dst, t)
    with caplog.at_level(logging.WARNING, logger="kvplan"):
        p = plan(src, dst, t, policy=Policy.TRUNCATE)
    assert p.transfers[0].state[0].src_list.tolist() == [0, 23]  # SGLang sends the padding page
    assert "no SWA slot" in caplog.text


def test_decode_side_rejects_its_own_unmapped_window():
    _, dst, _ = _swa_sides(map_dst=False)
    with pytest.raises(UnmappedSlotError):
        destination_lists(dst, 2, 0, 4, request="d1")


# ---- regressions from SGLang's record --------------------------------------------------------


def test_pr27004_state_lists_are_built_over_the_prompt_not_the_sampled_token():
    # L = 8 page aligned (ps 4); fill_len = 9 holds the sampled token. Building over 9 would add a
    # third DSA page and shift the SWA window by one page.
    table = table_with({1: [3, 4, 6]}, page_size=4)  # the sampled token got a slot on page 6
    dsa = StateComponent(StateKind.DSA, entries(SK + (1 << 31), 2, 8448))
    full_to_swa = np.zeros(64 * 4, np.int64)
    full_to_swa[12:20] = np.arange(40, 48)
    full_to_swa[24:28] = np.arange(80, 84)
    src = mha_side(SK, page_size=4, table=table, state=[dsa, swa(SK + (1 << 30), full_to_swa, window=4)])
    dst_table = table_with({1: [7, 8]}, page_size=4)
    dst_map = np.zeros(64 * 4, np.int64)
    dst_map[28:36] = np.arange(60, 68)
    dst = mha_side(DK, page_size=4, table=dst_table, state=[
        StateComponent(StateKind.DSA, entries(DK + (1 << 31), 2, 8448)), swa(DK + (1 << 30), dst_map, window=4)])
    dl = destination_lists(dst, 1, 0, 8)
    p = plan(src, dst, last_transfer(length=8, fill_len=9, dst_pages=dl.pages, dst_state=dl.state))
    dsa_plan, swa_plan = p.transfers[0].state
    assert dsa_plan.src_list.tolist() == [3, 4] and dsa_plan.dst_list.tolist() == [7, 8]
    assert swa_plan.src_list.tolist() == [11] and swa_plan.dst_list.tolist() == [16]
    assert p.transfers[0].end == 8


def test_issue18727_mismatched_state_list_lengths():
    src, dst, _ = _swa_sides(page_size=1, window=3, length=4)
    dl = destination_lists(dst, 2, 0, 4)
    short = (dl.state[0][:1],)
    t = last_transfer(length=4, dst_pages=dl.pages, dst_state=short)
    with pytest.raises(LengthMismatchError, match="'r1'.*component swa.*3 entries, destination 1"):
        plan(src, dst, t)
    p = plan(src, dst, t, policy=Policy.TRUNCATE)
    assert len(p.transfers[0].state[0].src_list) == 1


def test_ring_mismatch_is_strict_even_under_truncate():
    table = table_with({1: [3, 4, 5, 6]}, page_size=1)
    ring = lambda base: StateComponent(StateKind.SWA_RING, entries(base, 1, 256, 32), window=3, ring_size=4)  # noqa: E731
    src = mha_side(SK, table=table, state=[ring(SK + (1 << 30))])
    dst = mha_side(DK, state=[ring(DK + (1 << 30))])
    with pytest.raises(LengthMismatchError, match="swa_ring"):
        plan(src, dst, last_transfer(length=4, dst_pages=[1, 2, 3, 4], dst_state=[[9, 10]]), policy=Policy.TRUNCATE)
    p = plan(src, dst, last_transfer(length=4, dst_pages=[1, 2, 3, 4], dst_state=[[9, 10, 11]]))
    assert p.transfers[0].state[0].src_list.tolist() == [5, 6, 7]  # row 1 * R 4 + pos % 4 for pos 1..3


def test_pr24878_component_with_mixed_item_lengths_moves_every_entry():
    # a DSv4-style component: SWA KV, compressed state and indexer entries of different sizes
    table = table_with({1: [3, 4]}, page_size=2)
    sizes = (4096, 1152, 8448)
    mixed = lambda base: StateComponent(  # noqa: E731
        StateKind.DSA, tuple(Entry(base + i * (1 << 24), s, 16) for i, s in enumerate(sizes)), page_size=2)
    src = mha_side(SK, layers=1, page_size=2, item_len=64, table=table, state=[mixed(SK + (1 << 30))])
    dst = mha_side(DK, layers=1, page_size=2, item_len=64, table=table_with({1: [9, 10]}, 2),
                   state=[mixed(DK + (1 << 30))])
    dl = destination_lists(dst, 1, 0, 4)
    p = plan(src, dst, last_transfer(length=4, dst_pages=dl.pages, dst_state=dl.state))
    comp = p.transfers[0].state[0]
    assert comp.descs[:, 2].tolist() == [2 * s for s in sizes]
    rng = np.random.default_rng(0)
    sa, da = AddressSpace.of_side(src, rng), AddressSpace.of_side(dst)
    execute(p.transfers[0].descs, sa, da)
    for s_entry, d_entry in zip(src.state[0].entries, dst.state[0].entries):
        for sp, dp in ((3, 9), (4, 10)):
            assert np.array_equal(sa.entry_bytes(s_entry, sp), da.entry_bytes(d_entry, dp))


def test_pr25699_dense_last_chunk_carries_aux_and_expects_no_state():
    table = table_with({1: [3, 4]}, page_size=1)
    aux = lambda base: (Entry(base, 8, 16), Entry(base + 4096, 64, 16))  # noqa: E731
    src = mha_side(SK, table=table, aux=aux(SK + (1 << 30)))
    dst = mha_side(DK, aux=aux(DK + (1 << 30)))
    p = plan(src, dst, last_transfer(length=2, dst_pages=[5, 6], aux_src=3, aux_dst=7))
    t = p.transfers[0]
    assert t.state == () and t.expected_components == ()
    assert t.aux_descs.tolist() == [[SK + (1 << 30) + 24, DK + (1 << 30) + 56, 8],
                                    [SK + (1 << 30) + 4096 + 192, DK + (1 << 30) + 4096 + 448, 64]]
    with pytest.raises(PoolBoundsError, match="aux"):
        plan(src, dst, last_transfer(length=2, dst_pages=[5, 6], aux_src=3, aux_dst=99))


def test_pr27004_one_empty_side():
    assert group_concurrent_contiguous(np.array([], np.int64), np.array([1, 2])) == ([], [])
    # in the planner, under strict, one empty side of a component is an error
    table = table_with({1: [3, 4]}, page_size=1)
    dsa = lambda base: StateComponent(StateKind.DSA, entries(base, 1, 256))  # noqa: E731
    src = mha_side(SK, table=table, state=[dsa(SK + (1 << 30))])
    dst = mha_side(DK, state=[dsa(DK + (1 << 30))])
    with pytest.raises(LengthMismatchError, match="'r1'"):
        plan(src, dst, last_transfer(length=2, dst_pages=[5, 6], dst_state=[[]]))
    p = plan(src, dst, last_transfer(length=2, dst_pages=[5, 6], dst_state=[[]]), policy=Policy.TRUNCATE)
    assert len(p.transfers[0].state[0].descs) == 0
