"""Mamba state between different TP sizes (docs/tp_state.md §4): the golden vectors of §5 written by
hand, every rank's part of a whole model's tensors landing where the destination rank holds it
(scatter and gather, GDN shard groups, outer rows, replicated items), the device bit for bit, and
the pairings that must be refused."""

from dataclasses import replace

import numpy as np
import pytest

from kvplan.errors import LayoutError
from kvplan.planner.device import eager
from kvplan.planner.contract.batch import Attention, Batch, Entry, KVLayout, SideMemory, StateComponent, StateKind, Transfer
from kvplan.planner.contract.batch import TensorShard
from kvplan.planner.reference.oracle import plan_reference
from kvplan.tools.scenarios import ShardedTensor, build_batch
from kvplan.tools.verify import AddressSpace, execute
from tests.transport.handoff import MAMBA_TENSORS, MAMBA_TP4TO8

TENSORS, MODEL = MAMBA_TENSORS, replace(MAMBA_TP4TO8, src_tp=1, dst_tp=1)  # docs/tp_state.md §5's four tensors
SB, DB, SRC_SLOT, DST_SLOT = 0x1000_0000, 0x9000_0000, 3, 5


def golden_batch(ts: int, src_rank: int, td: int, dst_rank: int) -> Batch:
    """One request whose Mamba slot is 3 on the source and 5 on the destination; entry ``e`` of a
    side is at ``base + e * 2**20``."""
    def side(base, tp, rank, table=None, slot_map=None):
        kv = KVLayout(Attention.MLA, 4, (Entry(base + (1 << 28), 64, 16),), tp_size=tp, tp_rank=rank)
        items, shards = zip(*(t.on(tp) for t in TENSORS))
        entries = tuple(Entry(base + e * (1 << 20), item, 8) for e, item in enumerate(items))
        return SideMemory(kv, (StateComponent(StateKind.MAMBA, entries, slot_map=slot_map, shards=shards),),
                          req_to_token=table)

    table = np.zeros((2, 8), np.int32)
    table[1, :4] = np.arange(4, 8)
    src = side(SB, ts, src_rank, table, np.array([0, SRC_SLOT]))
    dst = side(DB, td, dst_rank)
    transfer = Transfer("r", 1, 0, 5, 4, True, np.array([2]), dst_state=(np.array([DST_SLOT]),))
    return Batch(src, (dst,), (transfer,))


VECTORS = {  # docs/tp_state.md §5: (ts, src rank, td, dst rank) -> per entry (src offset, dst offset, bytes)
    "I: TP 4 -> 8": ((4, 1, 8, 3), [[(2, 0, 2), (6, 2, 2), (12, 4, 4)], [(4, 0, 4)], [(1, 0, 1), (3, 1, 1)],
                                    [(0, 0, 6)]]),
    "J: TP 8 -> 4": ((8, 5, 4, 2), [[(0, 2, 2), (2, 6, 2), (4, 12, 4)], [(0, 4, 4)], [(0, 1, 1), (1, 3, 1)], []]),
    "J': TP 8 -> 4, first writer": ((8, 4, 4, 2), [[(0, 0, 2), (2, 4, 2), (4, 8, 4)], [(0, 0, 4)],
                                                  [(0, 0, 1), (1, 2, 1)], [(0, 0, 6)]]),
    "K: TP 2 -> 8": ((2, 0, 8, 2), [[(4, 0, 2), (12, 2, 2), (24, 4, 4)], [(8, 0, 4)], [(2, 0, 1), (6, 1, 1)],
                                    [(0, 0, 6)]]),
}


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_golden_vectors(name):
    layout, blocks = VECTORS[name]
    batch = golden_batch(*layout)
    src_items = [e.item_len for e in batch.src.state[0].entries]
    dst_items = [e.item_len for e in batch.dsts[0].state[0].entries]
    want = [(SB + e * (1 << 20) + SRC_SLOT * src_items[e] + so, DB + e * (1 << 20) + DST_SLOT * dst_items[e] + do, n)
            for e, rows in enumerate(blocks) for so, do, n in rows]
    plan = plan_reference(batch)
    assert [tuple(map(int, d)) for d in plan.transfers[0].state[0].descs] == want


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_the_device_planner_reproduces_the_golden_vectors(device, name):
    batch = golden_batch(*VECTORS[name][0])
    expected = plan_reference(batch)
    pending = eager.plan(batch.to(device))
    pending.result().assert_equal(expected)
    assert np.array_equal(pending.descriptors()[0], expected.descriptors()[0])
    assert pending.sections() == expected.sections()


# -- the whole model's tensors, sharded on both sides ---------------------------------------------------

def rank_part(tensor: ShardedTensor, content: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """A rank's item of one slot: of every outer row, its part of each shard group, in group order."""
    if tensor.full_dim == 0:
        return content.reshape(-1)
    rows = content.reshape(tensor.outer, tensor.full_dim, tensor.unit)
    positions, start = [], 0
    for g in tensor.groups or (tensor.full_dim,):
        positions += range(start + rank * g // tp, start + (rank + 1) * g // tp)
        start += g
    return rows[:, positions, :].reshape(-1)


def sources_of(ts: int, td: int, dst_rank: int) -> list[int]:
    """The source ranks that write into a destination rank's items: one when scattering, the whole
    aggregated group when gathering."""
    if ts <= td:
        return [dst_rank // (td // ts)]
    return [dst_rank * (ts // td) + j for j in range(ts // td)]


@pytest.mark.parametrize("ts, td, dst_rank", [(4, 8, 3), (8, 4, 2), (2, 8, 5), (1, 4, 3), (4, 1, 0), (8, 2, 1)])
@pytest.mark.parametrize("chunks", [1, 2])
def test_every_rank_part_lands_where_the_destination_holds_it_and_the_device_plans_alike(device, ts, td, dst_rank,
                                                                                       chunks):
    """Each slot of each tensor is a whole model's random bytes. Every source rank that serves the
    destination rank executes its plan (the reference's descriptors) from its own part; the
    destination rank then holds exactly its own part of every tensor, replicated items included
    (one source writes them). The device's plan equals the reference's for every source rank."""
    model = replace(MODEL, src_tp=ts, dst_tp=td)
    lens = [100, 37, 64]
    rng = np.random.default_rng(7)
    dst_space = None
    full = None
    for src_rank in sources_of(ts, td, dst_rank):
        batch = build_batch(model, requests=len(lens), prompt_len=lens, chunks=chunks, seed=11, src_rank=src_rank,
                            dst_rank=dst_rank)
        src_comp, dst_comp = batch.src.state[0], batch.dsts[0].state[0]
        slots = [int(src_comp.slot_map[t.src_row]) for t in batch.transfers if t.last]
        if full is None:  # per entry and request: the whole tensor's bytes of its slot
            full = [[rng.integers(0, 256, t.outer * max(t.full_dim, 1) * t.unit, dtype=np.uint8) for _ in slots]
                    for t in (TENSORS[e % len(TENSORS)] for e in range(len(src_comp.entries)))]
            dst_space = AddressSpace.of_side(batch.dsts[0])
        src_space = AddressSpace.of_side(batch.src, rng)
        for e, entry in enumerate(src_comp.entries):
            tensor = TENSORS[e % len(TENSORS)]
            for r, slot in enumerate(slots):
                arr, off = src_space.locate(entry.base_ptr + slot * entry.item_len, entry.item_len)
                arr[off : off + entry.item_len] = rank_part(tensor, full[e][r], ts, src_rank)
        plan = plan_reference(batch)
        mamba = np.concatenate([c.descs for tp in plan.transfers for c in tp.state]).reshape(-1, 3)
        execute(mamba, src_space, dst_space)
        pending = eager.plan(batch.to(device))
        pending.result().assert_equal(plan)
        assert np.array_equal(pending.descriptors()[0], plan.descriptors()[0])
    dst_slots = [int(t.dst_state[0][0]) for t in batch.transfers if t.last]
    for e, entry in enumerate(dst_comp.entries):
        tensor = TENSORS[e % len(TENSORS)]
        for r, slot in enumerate(dst_slots):
            arr, off = dst_space.locate(entry.base_ptr + slot * entry.item_len, entry.item_len)
            assert np.array_equal(arr[off : off + entry.item_len], rank_part(tensor, full[e][r], td, dst_rank)), (e, r)


# -- refusals -------------------------------------------------------------------------------------------

def test_a_rank_that_does_not_hold_the_destination_part_is_refused():
    with pytest.raises(LayoutError, match="destination rank 3 of TP 8 takes its part from source rank 1"):
        plan_reference(golden_batch(4, 2, 8, 3))
    with pytest.raises(LayoutError, match="source rank 5 of TP 8 writes into destination rank 2"):
        plan_reference(golden_batch(8, 5, 4, 1))


def _with_shards(batch: Batch, src_shards, dst_shards) -> Batch:
    comp = lambda side, shards: replace(side, state=(replace(side.state[0], shards=shards),))  # noqa: E731
    return replace(batch, src=comp(batch.src, src_shards), dsts=(comp(batch.dsts[0], dst_shards),))


def test_mamba_without_shards_is_refused_between_tp_sizes_and_moves_whole_between_equal_ones():
    batch = golden_batch(4, 1, 8, 3)
    with pytest.raises(LayoutError, match=r"state component 0 \(mamba\).*must declare how they are sharded"):
        plan_reference(_with_shards(batch, (), batch.dsts[0].state[0].shards))
    same = golden_batch(4, 1, 4, 1)
    plan = plan_reference(_with_shards(same, (), ()))
    assert [int(n) for n in plan.transfers[0].state[0].descs[:, 2]] == [e.item_len for e in same.src.state[0].entries]


@pytest.mark.parametrize("change, match", [
    (lambda s: TensorShard(s.dim + 1, s.outer, s.groups), "sharded dimension differs"),
    (lambda s: TensorShard(s.dim, s.outer, s.groups[::-1]), "shard the tensor differently"),
    (lambda s: TensorShard(0), "the other replicates it"),
])
def test_shards_that_do_not_describe_one_tensor_are_refused(change, match):
    batch = golden_batch(4, 1, 8, 3)
    dst_shards = batch.dsts[0].state[0].shards
    with pytest.raises(LayoutError, match=f"state component 0 \\(mamba\\) entry 0: .*{match}"):
        plan_reference(_with_shards(batch, batch.src.state[0].shards, (change(dst_shards[0]), *dst_shards[1:])))


def test_groups_that_do_not_split_into_the_ranks_are_refused():
    batch = golden_batch(4, 1, 8, 3)
    bad = lambda shards: (TensorShard(shards[0].dim, 1, (4, 12, 16)), *shards[1:])  # noqa: E731
    with pytest.raises(LayoutError, match=r"groups \(4, 12, 16\) must sum to the dimension 32 and each split into 8"):
        plan_reference(_with_shards(batch, bad(batch.src.state[0].shards), bad(batch.dsts[0].state[0].shards)))


def test_a_shard_count_that_differs_from_the_entries_is_refused():
    with pytest.raises(LayoutError, match="1 shards for 2 entries"):
        StateComponent(StateKind.MAMBA, (Entry(0x1000, 8, 4), Entry(0x2000, 8, 4)), shards=(TensorShard(2),))


# -- tensors in spans of a padded item (vLLM's Mamba page) ------------------------------------------------

PAD = 8  # bytes after the page's tensors


def paged_batch(ts: int, src_rank: int, td: int, dst_rank: int) -> Batch:
    """:func:`golden_batch`'s request over sides whose first two tensors share one padded item, as vLLM's Mamba
    page holds a layer's conv and temporal states: two entries over the same memory, each shard naming its
    tensor's span."""
    def side(base, tp, rank, table=None, slot_map=None):
        kv = KVLayout(Attention.MLA, 4, (Entry(base + (1 << 28), 64, 16),), tp_size=tp, tp_rank=rank)
        (conv, conv_shard), (temporal, temporal_shard) = (t.on(tp) for t in TENSORS[:2])
        page = conv + temporal + PAD
        shards = (replace(conv_shard, nbytes=conv), replace(temporal_shard, offset=conv, nbytes=temporal))
        return SideMemory(kv, (StateComponent(StateKind.MAMBA, (Entry(base, page, 8),) * 2, slot_map=slot_map,
                                              shards=shards),), req_to_token=table)

    table = np.zeros((2, 8), np.int32)
    table[1, :4] = np.arange(4, 8)
    transfer = Transfer("r", 1, 0, 5, 4, True, np.array([2]), dst_state=(np.array([DST_SLOT]),))
    return Batch(side(SB, ts, src_rank, table, np.array([0, SRC_SLOT])), (side(DB, td, dst_rank),), (transfer,))


@pytest.mark.parametrize("ts, src_rank, td, dst_rank", [(4, 1, 4, 1), (4, 1, 8, 3), (8, 5, 4, 2), (1, 0, 2, 1)])
def test_tensors_in_spans_of_a_padded_item_land_as_the_destination_rank_holds_them_and_never_the_padding(
        device, ts, src_rank, td, dst_rank):
    """Each tensor's rank part lands at its span of the destination's page; the padding is never sent (between
    equal TP sizes too: each span in one descriptor); the device plans what the reference plans."""
    batch = paged_batch(ts, src_rank, td, dst_rank)
    rng = np.random.default_rng(5)
    full = [rng.integers(0, 256, t.outer * t.full_dim * t.unit, dtype=np.uint8) for t in TENSORS[:2]]
    src_page, dst_page = (c.state[0].entries[0].item_len for c in (batch.src, batch.dsts[0]))
    src_bytes = np.concatenate([*(rank_part(t, f, ts, src_rank) for t, f in zip(TENSORS, full)),
                                np.full(PAD, 0xEE, np.uint8)])
    plan = plan_reference(batch)
    descs = plan.transfers[0].state[0].descs
    dst_bytes = np.zeros(dst_page, np.uint8)
    for src, dst, n in (tuple(map(int, d)) for d in descs):
        at = src - SB - SRC_SLOT * src_page
        dst_bytes[dst - DB - DST_SLOT * dst_page : dst - DB - DST_SLOT * dst_page + n] = src_bytes[at : at + n]
    want = np.concatenate([rank_part(t, f, td, dst_rank) for t, f in zip(TENSORS, full)])
    sent = sum(int(d[2]) for d in descs)
    if ts == td:
        assert len(descs) == 2 and sent == src_page - PAD
        assert np.array_equal(dst_bytes[: len(want)], want)
    else:  # (a gather's source writes its own part of each tensor only)
        written = [k for s, d, n in (tuple(map(int, d)) for d in descs)
                   for k in range(d - DB - DST_SLOT * dst_page, d - DB - DST_SLOT * dst_page + n)]
        assert written and max(written) < len(want) and np.array_equal(dst_bytes[written], want[written])
    pending = eager.plan(batch.to(device))
    pending.result().assert_equal(plan)


def test_a_tensor_span_that_overruns_its_item_is_refused():
    batch = paged_batch(4, 1, 8, 3)
    shards = batch.dsts[0].state[0].shards
    bad = (shards[0], replace(shards[1], nbytes=shards[1].nbytes + PAD + 1))
    with pytest.raises(LayoutError, match=r"entry 1: the destination's tensor of \d+ bytes at \d+ overruns its item"):
        plan_reference(_with_shards(batch, batch.src.state[0].shards, bad))
    with pytest.raises(LayoutError, match="with an offset, nbytes > 0"):
        TensorShard(4, offset=8)
