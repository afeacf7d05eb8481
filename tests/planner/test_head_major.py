"""KV whose pages hold each head's tokens in a row (``Attention.MHA_HEAD_MAJOR``: vLLM's ``LBHNC`` blocks,
the heads outside the tokens): between TP sizes a destination rank receives its heads of each page as one
span, one descriptor per layer x page, K and V together; at equal TP pages move whole in runs. Checked by
executing the reference's descriptors on made-up pools and comparing every head of every token, and the
device planner against the reference."""

import numpy as np
import pytest

from kvplan.errors import LayoutError
from kvplan.planner.contract.batch import Attention, Batch, Entry, KVLayout, SideMemory
from kvplan.planner.contract.pairing import Mode, pair_sides
from kvplan.planner.reference.oracle import plan_reference
from kvplan.tools.verify import AddressSpace, execute
from tests.planner.builders import assert_device_matches_reference, last_transfer, table_with

HEADS, HEAD_BYTES, PAGE, PAGES, LAYERS = 8, 16, 4, 32, 2  # HEAD_BYTES: one head's K and V of one token


def _side(tp: int, rank: int, base: int, table, page: int = PAGE) -> SideMemory:
    item = HEADS // tp * page * HEAD_BYTES
    entries = tuple(Entry(base + layer * (1 << 20), item, PAGES) for layer in range(LAYERS))
    return SideMemory(KVLayout(Attention.MHA_HEAD_MAJOR, page, entries, num_kv_heads=HEADS, tp_size=tp,
                               tp_rank=rank), req_to_token=table)


def _head_token(space: AddressSpace, side: SideMemory, layer: int, slot: int, head: int) -> np.ndarray:
    """One head's bytes of the token at ``slot`` (page ``slot // PAGE``: ``[heads, PAGE, HEAD_BYTES]``)."""
    entry = side.kv.entries[layer]
    page, token = divmod(slot, PAGE)
    arr, off = space.locate(entry.base_ptr + page * entry.item_len + (head * PAGE + token) * HEAD_BYTES, HEAD_BYTES)
    return arr[off : off + HEAD_BYTES]


@pytest.mark.parametrize("src_tp, src_rank, dst_tp, dst_rank", [
    (1, 0, 2, 1), (2, 1, 4, 3), (4, 2, 8, 5),   # scatter: the destination's heads, a span of each source page
    (2, 1, 1, 0), (4, 3, 2, 1), (8, 6, 2, 1),   # gather: the source's heads at their place in each destination page
    (2, 1, 2, 1),                                # equal TP: pages whole, in runs
])
def test_each_destination_rank_receives_its_heads_one_span_per_page(src_tp, src_rank, dst_tp, dst_rank, device):
    prompt = 13  # (a last page of one token)
    src = _side(src_tp, src_rank, 1 << 32, table_with({1: [5, 9, 2, 7]}, PAGE))
    dst = _side(dst_tp, dst_rank, 1 << 36, table_with({2: [11, 3, 20, 6]}, PAGE))
    pairing = pair_sides(src, dst)
    assert pairing.mode is (Mode.DIRECT if src_tp == dst_tp else Mode.HEAD_SLICED)
    batch = Batch(src, (dst,), (last_transfer(row=1, length=prompt, dst_pages=[11, 3, 20, 6]),))
    plan = plan_reference(batch)
    descs = plan.descriptors()[0]
    if src_tp != dst_tp:
        assert len(descs) == LAYERS * 4  # one per layer x page
    src_space, dst_space = AddressSpace.of_side(src, np.random.default_rng(7)), AddressSpace.of_side(dst)
    execute(descs, src_space, dst_space)
    src_heads, dst_heads = HEADS // src_tp, HEADS // dst_tp
    checked = 0
    for layer in range(LAYERS):
        for pos in range(prompt):
            s_slot, d_slot = int(src.req_to_token[1, pos]), int(dst.req_to_token[2, pos])
            for model_head in range(HEADS):  # every head both ranks hold
                s_head, d_head = model_head - src_rank * src_heads, model_head - dst_rank * dst_heads
                if 0 <= s_head < src_heads and 0 <= d_head < dst_heads:
                    assert np.array_equal(_head_token(dst_space, dst, layer, d_slot, d_head),
                                          _head_token(src_space, src, layer, s_slot, s_head)), (layer, pos, model_head)
                    checked += 1
    assert checked == LAYERS * prompt * min(src_heads, dst_heads)
    assert_device_matches_reference(batch, device)


def test_other_heads_of_a_destination_page_are_left_alone():
    """A gather writes only its heads: the rest of each destination page keeps what it held."""
    src = _side(2, 1, 1 << 32, table_with({1: [5, 9]}, PAGE))
    dst = _side(1, 0, 1 << 36, table_with({2: [11, 3]}, PAGE))
    batch = Batch(src, (dst,), (last_transfer(row=1, length=8, dst_pages=[11, 3]),))
    dst_space = AddressSpace.of_side(dst, np.random.default_rng(3))
    before = {p: _head_token(dst_space, dst, 0, p * PAGE, 0).copy() for p in (11, 3)}
    execute(plan_reference(batch).descriptors()[0], AddressSpace.of_side(src, np.random.default_rng(7)), dst_space)
    for p in (11, 3):
        assert np.array_equal(_head_token(dst_space, dst, 0, p * PAGE, 0), before[p])  # head 0: rank 0's


def test_page_sizes_must_be_equal():
    src = _side(1, 0, 1 << 32, None)
    with pytest.raises(LayoutError, match="page sizes must be equal"):
        pair_sides(src, _side(2, 0, 1 << 36, None, page=2 * PAGE))
    with pytest.raises(LayoutError, match="page sizes must be equal"):
        pair_sides(src, _side(1, 0, 1 << 36, None, page=2 * PAGE))
    packed = SideMemory(KVLayout(Attention.MHA_PACKED, PAGE, src.kv.entries, num_kv_heads=HEADS))
    with pytest.raises(LayoutError, match="attention kinds differ"):
        pair_sides(src, packed)


@pytest.mark.parametrize("src_tp, src_rank, dst_tp, dst_rank", [(4, 2, 8, 5), (8, 5, 4, 2)])
def test_a_side_of_one_head_per_rank_pairs_with_either_packed_kind(src_tp, src_rank, dst_tp, dst_rank, device):
    """One head per rank is the same bytes with the heads inside or outside the tokens: such a side (declared
    token-major, as vLLM's views of one head look) pairs with a head-major peer, sliced as the peer lays out."""
    src = _side(src_tp, src_rank, 1 << 32, table_with({1: [5, 9, 2]}, PAGE))
    dst = _side(dst_tp, dst_rank, 1 << 36, table_with({2: [11, 3, 20]}, PAGE))
    one_head = dst if dst_tp == 8 else src
    packed = SideMemory(KVLayout(Attention.MHA_PACKED, PAGE, one_head.kv.entries, num_kv_heads=HEADS,
                                 tp_size=8, tp_rank=one_head.kv.tp_rank), req_to_token=one_head.req_to_token)
    src, dst = (src, packed) if dst_tp == 8 else (packed, dst)
    batch = Batch(src, (dst,), (last_transfer(row=1, length=12, dst_pages=[11, 3, 20]),))
    descs = plan_reference(batch).descriptors()[0]
    assert pair_sides(src, dst).heads.per_page and len(descs) == LAYERS * 3
    src_space, dst_space = AddressSpace.of_side(src, np.random.default_rng(5)), AddressSpace.of_side(dst)
    execute(descs, src_space, dst_space)
    head_in_src = (dst_rank - src_rank * 2) if dst_tp == 8 else 0
    head_in_dst = 0 if dst_tp == 8 else src_rank - dst_rank * 2
    for layer in range(LAYERS):
        for pos in range(12):
            s_slot, d_slot = int(src.req_to_token[1, pos]), int(dst.req_to_token[2, pos])
            assert np.array_equal(_head_token(dst_space, dst, layer, d_slot, head_in_dst),
                                  _head_token(src_space, src, layer, s_slot, head_in_src))
    assert_device_matches_reference(batch, device)


@pytest.mark.parametrize("src_tp, src_rank, dst_tp, dst_rank", [(2, 1, 4, 3), (4, 3, 2, 1)])
def test_prepared_lists_of_each_page_s_head_slice_name_the_bytes_the_descriptors_move(src_tp, src_rank, dst_tp,
                                                                                      dst_rank, device):
    """NIXL prepared lists (vLLM's NIXL connector's form between TP sizes in LBHNC): one descriptor per layer x
    block, each the page's head slice; the planner's indices into them are the descriptors, in order."""
    from kvplan.planner.device.planner import Planner
    from kvplan.planner.device.columns import BatchColumns
    from kvplan.planner.device.prepared import KV, prepared_indices_reference
    from kvplan.transport.engines.nixl import expanded_rows
    from kvplan.transport.senders.prepared import prepared_items

    src = _side(src_tp, src_rank, 1 << 32, table_with({1: [5, 9, 2, 7]}, PAGE))
    dst = _side(dst_tp, dst_rank, 1 << 36, table_with({2: [11, 3, 20, 6]}, PAGE))
    batch = Batch(src, (dst,), (last_transfer(row=1, length=13, dst_pages=[11, 3, 20, 6]),))
    plan = plan_reference(batch)
    indices = prepared_indices_reference(batch, plan)
    src_items, dst_items = prepared_items(src, dst)[KV]
    src_list, dst_list = expanded_rows(src_items, 0), expanded_rows(dst_items, 0)
    named = np.stack([src_list[indices.src, 0], dst_list[indices.dst, 0], src_list[indices.src, 1]], axis=1)
    assert np.array_equal(dst_list[indices.dst, 1], named[:, 2])
    assert np.array_equal(named, plan.descriptors()[0].astype(np.uint64))
    on_device = batch.to(device)
    planner = Planner(on_device.src, on_device.dsts, outputs=("prepared",))
    indices.assert_equal(planner.plan(BatchColumns.from_batch(on_device)).prepared_indices())


def test_prepared_lists_are_refused_where_a_head_slice_is_one_per_token():
    from kvplan.planner.device.prepared import prepared_indices_reference

    def packed(tp, rank, base, table):
        side = _side(tp, rank, base, table)
        return SideMemory(KVLayout(Attention.MHA_PACKED, PAGE, side.kv.entries, num_kv_heads=HEADS, tp_size=tp,
                                   tp_rank=rank), req_to_token=table)

    src, dst = packed(1, 0, 1 << 32, table_with({1: [5]}, PAGE)), packed(2, 1, 1 << 36, None)
    batch = Batch(src, (dst,), (last_transfer(row=1, length=4, dst_pages=[11]),))
    with pytest.raises(LayoutError, match="head slices of each token"):
        prepared_indices_reference(batch, plan_reference(batch))


@pytest.mark.parametrize("src_tp, src_rank, dst_tp, dst_rank", [(2, 1, 4, 3), (4, 3, 2, 1), (2, 1, 2, 1)])
def test_a_sliding_window_component_of_head_major_pages_moves_its_window_by_head_one_span_per_page(
        src_tp, src_rank, dst_tp, dst_rank, device):
    """vLLM's sliding-window KV cache groups in LBHNC: a SWA component whose pages hold each head's tokens in a
    row, reached through a map from the KV's slots (a request's sliding-window blocks are its own); between TP
    sizes each destination rank receives its heads of each window page as one span; the prepared lists name the
    same bytes."""
    from kvplan.planner.contract.batch import StateComponent, StateKind
    from kvplan.planner.device.prepared import prepared_indices_reference
    from kvplan.transport.engines.nixl import expanded_rows
    from kvplan.transport.senders.prepared import prepared_items

    window, prompt = 6, 14  # (window pages: tokens 8..13, pages 2 and 3 of the request)

    def side(tp, rank, base, table, kv_pages, swa_pages):
        kv = _side(tp, rank, base, table)
        slot_map = np.zeros(PAGES * PAGE, np.int64)
        for full, swa in zip(kv_pages, swa_pages):
            slot_map[full * PAGE : full * PAGE + PAGE] = np.arange(swa * PAGE, swa * PAGE + PAGE)
        item = HEADS // tp * PAGE * HEAD_BYTES
        swa_entries = tuple(Entry(base + (1 << 24) + layer * (1 << 20), item, PAGES) for layer in range(LAYERS))
        comp = StateComponent(StateKind.SWA, swa_entries, window=window, slot_map=slot_map, from_prefix=True)
        return SideMemory(kv.kv, (comp,), req_to_token=table)

    src = side(src_tp, src_rank, 1 << 32, table_with({1: [5, 9, 2, 7]}, PAGE), [5, 9, 2, 7], [0, 0, 12, 30])
    dst = side(dst_tp, dst_rank, 1 << 36, table_with({2: [11, 3, 20, 6]}, PAGE), [11, 3, 20, 6], [4, 8, 16, 25])
    batch = Batch(src, (dst,), (last_transfer(row=1, length=prompt, dst_pages=[11, 3, 20, 6],
                                              dst_state=(np.array([16, 25], np.int64),)),))
    plan = plan_reference(batch)
    comp_plan = plan.transfers[0].state[0]
    assert comp_plan.src_list.tolist() == [12, 30] and comp_plan.dst_list.tolist() == [16, 25]
    if src_tp != dst_tp:
        assert len(comp_plan.descs) == LAYERS * 2  # one per layer x window page
    src_space, dst_space = AddressSpace.of_side(src, np.random.default_rng(11)), AddressSpace.of_side(dst)
    execute(plan.descriptors()[0], src_space, dst_space)
    src_heads, dst_heads = HEADS // src_tp, HEADS // dst_tp

    def swa_head_token(space, s, layer, page, token, head):
        entry = s.state[0].entries[layer]
        arr, off = space.locate(entry.base_ptr + page * entry.item_len + (head * PAGE + token) * HEAD_BYTES,
                                HEAD_BYTES)
        return arr[off : off + HEAD_BYTES]

    checked = 0
    for layer in range(LAYERS):
        for pos in range(prompt - window, prompt):
            s_page, d_page = (12, 30)[pos // PAGE - 2], (16, 25)[pos // PAGE - 2]
            for model_head in range(HEADS):
                s_head, d_head = model_head - src_rank * src_heads, model_head - dst_rank * dst_heads
                if 0 <= s_head < src_heads and 0 <= d_head < dst_heads:
                    assert np.array_equal(swa_head_token(dst_space, dst, layer, d_page, pos % PAGE, d_head),
                                          swa_head_token(src_space, src, layer, s_page, pos % PAGE, s_head))
                    checked += 1
    assert checked == LAYERS * window * min(src_heads, dst_heads)
    indices = prepared_indices_reference(batch, plan)
    lists = prepared_items(src, dst)
    named = []
    for s in range(len(indices.section_role)):
        lo, hi = indices.section_offsets[s], indices.section_offsets[s + 1]
        src_list, dst_list = (expanded_rows(items, 0) for items in lists[int(indices.section_role[s])])
        named.append(np.stack([src_list[indices.src[lo:hi], 0], dst_list[indices.dst[lo:hi], 0],
                               src_list[indices.src[lo:hi], 1]], axis=1))
    assert np.array_equal(np.concatenate(named), plan.descriptors()[0].astype(np.uint64))
    assert_device_matches_reference(batch, device)
