"""State components between different TP sizes (docs/tp_state.md): SWA head-sliced as KV, against
the golden vectors of §5 written by hand and a head-by-head byte copy; replicated kinds moved whole;
Mamba without shard declarations refused (sliced Mamba: test_tp_mamba.py); the device planner bit for bit."""

import numpy as np
import pytest

from kvplan.errors import LayoutError
from kvplan.planner.device import eager
from kvplan.planner.contract.batch import Attention, Batch, Entry, KVLayout, SideMemory, StateComponent, StateKind, Transfer
from kvplan.planner.reference.oracle import plan_reference

SB, DB, BPH, H = 0x1000_0000, 0x9000_0000, 2, 8
CPS, W, L = 4, 6, 10


def sides(heads, ts, src_rank, td, dst_rank):
    """One KV entry pair and one SWA entry pair; the request's SWA pages are [5, 9] -> [2, 7]."""
    def side(base, tp, rank, table=None, slot_map=None):
        tb = BPH * max(1, heads // tp)
        kv = KVLayout(Attention.MHA, CPS, (Entry(base, CPS * tb, 64), Entry(base + (1 << 20), CPS * tb, 64)),
                      num_kv_heads=heads, tp_size=tp, tp_rank=rank)
        swa = StateComponent(StateKind.SWA, (Entry(base + (2 << 20), CPS * tb, 64),), window=W, slot_map=slot_map)
        return SideMemory(kv, (swa,), req_to_token=table)

    table = np.zeros((2, 12), np.int32)
    table[1] = (np.array([11, 12, 13])[:, None] * CPS + np.arange(CPS)).reshape(-1)  # KV pages 11, 12, 13
    full_to_swa = np.zeros(64 * CPS, np.int64)
    for kv_page, swa_page in ((12, 5), (13, 9)):  # the window [4, 10) lies in KV pages 12 and 13
        full_to_swa[kv_page * CPS : (kv_page + 1) * CPS] = swa_page * CPS + np.arange(CPS)
    src = side(SB, ts, src_rank, table, full_to_swa)
    dst = side(DB, td, dst_rank)
    transfer = Transfer("r", 1, 0, L + 1, L, True, np.array([20, 21, 22]), dst_state=(np.array([2, 7]),))
    return Batch(src, (dst,), (transfer,))


def swa_descs(plan):
    comp = plan.transfers[0].state[0]
    return [(int(s) - SB - (2 << 20), int(d) - DB - (2 << 20), int(n)) for s, d, n in comp.descs]


VECTORS = {  # docs/tp_state.md §5: (heads, ts, src rank, td, dst rank) -> sources, destinations
    "F: TP 4 -> 8": ((H, 4, 1, 8, 3), [82, 86, 90, 94, 146, 150, 154, 158], [16, 18, 20, 22, 56, 58, 60, 62]),
    "G: TP 8 -> 4": ((H, 8, 5, 4, 2), [40, 42, 44, 46, 72, 74, 76, 78], [34, 38, 42, 46, 114, 118, 122, 126]),
    "H: TP 2 -> 8, 2 heads": ((2, 2, 1, 8, 5), [40, 42, 44, 46, 72, 74, 76, 78], [16, 18, 20, 22, 56, 58, 60, 62]),
}


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_golden_vectors(name):
    layout, srcs, dsts = VECTORS[name]
    plan = plan_reference(sides(*layout))
    assert swa_descs(plan) == [(s, d, BPH) for s, d in zip(srcs, dsts)]
    assert plan.transfers[0].state[0].src_list.tolist() == [5, 9]


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_the_device_planner_reproduces_the_golden_vectors(device, name):
    batch = sides(*VECTORS[name][0])
    expected = plan_reference(batch)
    pending = eager.plan(batch.to(device))
    pending.result().assert_equal(expected)
    assert np.array_equal(pending.descriptors()[0], expected.descriptors()[0])
    assert pending.sections() == expected.sections()


def test_components_that_are_not_head_sliced_keep_equal_items_or_declare_shards():
    batch = sides(H, 4, 1, 8, 3)
    src, dst = batch.src, batch.dsts[0]
    mamba = lambda n: StateComponent(StateKind.MAMBA, (Entry(0x5000_0000, n, 8),), slot_map=np.arange(4))  # noqa: E731
    with pytest.raises(LayoutError, match="must declare how they are sharded"):
        plan_reference(Batch(SideMemory(src.kv, src.state + (mamba(256),), req_to_token=src.req_to_token),
                             (SideMemory(dst.kv, dst.state + (mamba(128),)),), ()))

    def ring(n):
        return StateComponent(StateKind.SWA_RING, (Entry(0x5000_0000, n, 8),), window=2, ring_size=2)

    with pytest.raises(LayoutError, match="swa_ring state is replicated on every rank and moved whole"):
        plan_reference(Batch(SideMemory(src.kv, src.state + (ring(256),), req_to_token=src.req_to_token),
                             (SideMemory(dst.kv, dst.state + (ring(128),)),), ()))


# -- random batches: a head-by-head byte copy, and the device bit for bit -------------------------------

def global_heads(heads: int, tp: int, rank: int) -> list[int]:
    """The KV heads a rank holds, in its local order (replicated when there are fewer heads than ranks)."""
    per = max(1, heads // tp)
    first = rank * per if heads >= tp else rank // (tp // heads)
    return list(range(first, first + per))


@pytest.mark.parametrize("heads, ts, src_rank, td, dst_rank", [(8, 4, 1, 8, 3), (8, 8, 5, 4, 2), (2, 2, 1, 8, 5),
                                                               (4, 1, 0, 2, 1)])
@pytest.mark.parametrize("prefix_len, chunks", [(0, 1), (16, 2)])
def test_swa_heads_land_position_by_position_and_the_device_plans_alike(device, heads, ts, src_rank, td, dst_rank,
                                                                       prefix_len, chunks):
    """gpt-oss-like SWA between TP sizes, several requests, chunked, with a decode prefix: executing the
    reference's descriptors puts every shared head of every window position where the destination
    published it; the device's plan equals the reference's."""
    from dataclasses import replace

    from kvplan.tools.scenarios import build_batch
    from kvplan.tools.verify import AddressSpace, execute
    from tests.transport.handoff import SWA16

    bph = 16
    model = replace(SWA16, num_kv_heads=heads, src_tp=ts, dst_tp=td, token_bytes=bph * max(1, heads // td),
                    state=(replace(SWA16.state[0], item_len=16 * bph * max(1, heads // td)),))
    batch = build_batch(model, requests=3, prompt_len=[100, 37, 64], chunks=chunks, prefix_len=prefix_len, seed=3,
                        src_rank=src_rank, dst_rank=dst_rank)
    plan = plan_reference(batch)
    src_space = AddressSpace.of_side(batch.src, np.random.default_rng(1))
    dst_space = AddressSpace.of_side(batch.dsts[0])
    execute(plan.descriptors()[0], src_space, dst_space)
    src_comp, dst_comp = batch.src.state[0], batch.dsts[0].state[0]
    cps = src_comp.pages_of(batch.src.kv.page_size)
    tb_s, tb_d = src_comp.entries[0].item_len // cps, dst_comp.entries[0].item_len // cps
    src_heads, dst_heads = global_heads(heads, ts, src_rank), global_heads(heads, td, dst_rank)
    shared = [h for h in src_heads if h in dst_heads]
    assert shared, "the test's ranks must share a head"
    checked = 0
    for t in batch.transfers:
        if not t.last:
            continue
        ws = max(0, t.prompt_len - src_comp.window) // cps * cps
        dst_pages = np.asarray(t.dst_state[0])
        for pos in range(ws, t.prompt_len):
            slot_s = int(src_comp.slot_map[batch.src.req_to_token[t.src_row, pos]])
            slot_d = int(dst_pages[(pos - ws) // cps]) * cps + (pos - ws) % cps
            for e_s, e_d in zip(src_comp.entries, dst_comp.entries):
                for h in shared:
                    s_arr, s_off = src_space.locate(e_s.base_ptr + slot_s * tb_s + src_heads.index(h) * bph, bph)
                    d_arr, d_off = dst_space.locate(e_d.base_ptr + slot_d * tb_d + dst_heads.index(h) * bph, bph)
                    assert np.array_equal(d_arr[d_off : d_off + bph], s_arr[s_off : s_off + bph]), (t.request, pos, h)
                    checked += 1
    assert checked
    pending = eager.plan(batch.to(device))
    pending.result().assert_equal(plan)
    assert np.array_equal(pending.descriptors()[0], plan.descriptors()[0])
    assert pending.sections() == plan.sections()
