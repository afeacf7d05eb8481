"""KV with each head's K and V side by side in one entry per layer (``Attention.MHA_PACKED``, vLLM's blocks
with the tokens outside the heads): between TP sizes each destination rank receives, token by token, the
heads it holds, K and V together; at equal TP a block moves whole. Checked by executing the reference's
descriptors on made-up pools, and the device planner against the reference."""

import numpy as np
import pytest

from kvplan.planner.contract.batch import Attention, Batch, Entry, KVLayout, SideMemory
from kvplan.planner.contract.pairing import Mode, pair_sides
from kvplan.planner.reference.oracle import plan_reference
from kvplan.tools.verify import AddressSpace, execute
from tests.planner.builders import assert_device_matches_reference, last_transfer, table_with

HEADS, HEAD_BYTES, PAGE, PAGES, LAYERS = 4, 16, 4, 32, 2  # HEAD_BYTES: one head's K and V of one token


def _side(tp: int, rank: int, base: int, table) -> SideMemory:
    token = HEADS // tp * HEAD_BYTES
    entries = tuple(Entry(base + layer * (1 << 20), PAGE * token, PAGES) for layer in range(LAYERS))
    return SideMemory(KVLayout(Attention.MHA_PACKED, PAGE, entries, num_kv_heads=HEADS, tp_size=tp, tp_rank=rank),
                      req_to_token=table)


@pytest.mark.parametrize("src_tp, dst_tp, dst_rank", [(1, 2, 0), (1, 2, 1), (2, 4, 3), (2, 2, 1)])
def test_each_destination_rank_receives_its_heads_k_and_v_together(src_tp, dst_tp, dst_rank, device):
    prompt = 13  # (a last page of one token)
    src_rank = dst_rank * src_tp // dst_tp
    src = _side(src_tp, src_rank, 1 << 32, table_with({1: [5, 9, 2, 7]}, PAGE))
    dst = _side(dst_tp, dst_rank, 1 << 36, table_with({2: [11, 3, 20, 6]}, PAGE))
    assert pair_sides(src, dst).mode is (Mode.DIRECT if src_tp == dst_tp else Mode.HEAD_SLICED)
    batch = Batch(src, (dst,), (last_transfer(row=1, length=prompt, dst_pages=[11, 3, 20, 6]),))
    plan = plan_reference(batch)
    src_space, dst_space = AddressSpace.of_side(src, np.random.default_rng(7)), AddressSpace.of_side(dst)
    execute(plan.descriptors()[0], src_space, dst_space)
    src_token, dst_token = HEADS // src_tp * HEAD_BYTES, HEADS // dst_tp * HEAD_BYTES
    first_head = (dst_rank * (HEADS // dst_tp)) % (HEADS // src_tp)  # of the source rank's heads
    for layer in range(LAYERS):
        for pos in range(prompt):
            s_slot, d_slot = int(src.req_to_token[1, pos]), int(dst.req_to_token[2, pos])
            s_arr, s_off = src_space.locate(src.kv.entries[layer].base_ptr + s_slot * src_token, src_token)
            d_arr, d_off = dst_space.locate(dst.kv.entries[layer].base_ptr + d_slot * dst_token, dst_token)
            want = s_arr[s_off + first_head * HEAD_BYTES : s_off + first_head * HEAD_BYTES + dst_token]
            assert np.array_equal(d_arr[d_off : d_off + dst_token], want), (layer, pos)
    assert_device_matches_reference(batch, device)


def test_a_packed_side_has_one_entry_per_layer_and_pairs_only_with_packed():
    side = _side(1, 0, 1 << 32, None)
    assert side.kv.num_layers == LAYERS and Attention.MHA_PACKED.parts == 1 and Attention.MHA_PACKED.slices_heads
    mla = SideMemory(KVLayout(Attention.MLA, PAGE, side.kv.entries))
    with pytest.raises(Exception, match="attention kinds differ"):
        pair_sides(side, mla)
