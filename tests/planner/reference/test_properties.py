"""Property tests of the reference on random fragmented pools (hypothesis).

Descriptors are executed with NumPy on simulated byte buffers: every destination byte of every
request must be written exactly once, with the right source bytes.
"""

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.planner.contract.batch import Attention, StateKind
from kvplan.planner.contract.pairing import Mode
from kvplan.planner.reference.oracle import plan_reference
from kvplan.tools.scenarios import ComponentShape, ModelShape, build_batch
from kvplan.tools.verify import AddressSpace, execute

COMPONENTS = {
    StateKind.SWA: ComponentShape(StateKind.SWA, 2, 48, window=5),
    StateKind.DSA: ComponentShape(StateKind.DSA, 1, 40),
    StateKind.SWA_RING: ComponentShape(StateKind.SWA_RING, 2, 24, window=6, ring_size=8),
    StateKind.MAMBA: ComponentShape(StateKind.MAMBA, 3, 72),
}


@st.composite
def scenarios(draw, head_sliced=False):
    ps = draw(st.sampled_from([1, 2, 4, 8]))
    if head_sliced:
        heads = draw(st.sampled_from([1, 2, 4, 8]))
        src_tp, dst_tp = draw(st.sampled_from([(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (8, 2)]))
        attention, kinds = Attention.MHA, []
    else:
        heads, src_tp, dst_tp = 1, 1, 1
        attention = draw(st.sampled_from([Attention.MHA, Attention.MLA]))
        kinds = draw(st.lists(st.sampled_from(list(COMPONENTS)), max_size=3, unique=True))
    # SWA and DSA also in SGLang's variant that starts their lists at the decode prefix
    comps = tuple(dataclasses.replace(COMPONENTS[k], from_prefix=k in (StateKind.SWA, StateKind.DSA)
                                      and draw(st.booleans())) for k in kinds)
    bph = draw(st.sampled_from([4, 8]))
    shape = ModelShape(
        "random", attention, draw(st.integers(1, 3)), bph * max(1, heads // dst_tp), ps,
        state=comps, num_kv_heads=heads, src_tp=src_tp, dst_tp=dst_tp,
        mean_run=draw(st.sampled_from([1.5, 4.0])), aux_items=draw(st.sampled_from([(), (8,), (8, 24)])),
    )
    lens = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    batch = build_batch(
        shape, len(lens), lens, chunks=draw(st.integers(1, 3)), prefix_len=draw(st.sampled_from([0, 8])),
        seed=draw(st.integers(0, 2**31)), src_rank=draw(st.integers(0, src_tp - 1)),
        dst_rank=draw(st.integers(0, dst_tp - 1)),
    )
    return shape, batch


def _check_chunks_tile_requests(batch, plan):
    by_request = {}
    for t, tp in zip(batch.transfers, plan.transfers):
        by_request.setdefault(t.request, []).append((t, tp))
    for items in by_request.values():
        t0 = items[0][0]
        pos, pages = t0.prefix_len, []
        for t, tp in items:
            assert tp.start == pos, "each chunk starts where the last one ended"
            pos = tp.end
            pages += tp.dst_pages.tolist()
        assert pos == t0.prompt_len, "the last chunk ends at the prompt length"
        assert pages == t0.dst_pages.tolist(), "every destination page is sent exactly once"
        assert [tp.last for _, tp in items] == [False] * (len(items) - 1) + [True]


def _check_runs_maximal_and_exact(tp):
    if not len(tp.runs):
        assert len(tp.src_pages) == 0
        return
    s0, d0, n = tp.runs.T
    assert (n >= 1).all()
    expand = lambda base: np.concatenate([np.arange(b, b + k) for b, k in zip(base, n)])  # noqa: E731
    assert np.array_equal(expand(s0), tp.src_pages) and np.array_equal(expand(d0), tp.dst_pages)
    mergeable = (s0[:-1] + n[:-1] == s0[1:]) & (d0[:-1] + n[:-1] == d0[1:])
    assert not mergeable.any(), "runs are maximal"


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_direct_plans_move_every_byte_exactly_once(case):
    shape, batch = case
    plan = plan_reference(batch)
    _check_chunks_tile_requests(batch, plan)
    src, dst = batch.src, batch.dsts[0]
    rng = np.random.default_rng(0)
    src_mem, dst_mem, cover = AddressSpace.of_side(src, rng), AddressSpace.of_side(dst), AddressSpace.of_side(dst)
    n_kv = len(src.kv.entries)
    for tp in plan.transfers:
        assert tp.mode is Mode.DIRECT
        _check_runs_maximal_and_exact(tp)
        assert len(tp.kv_descs) == n_kv * len(tp.runs), "descriptor count = entries x runs"
        for comp, cp in zip(src.state, tp.state):
            assert np.array_equal(cp.src_list.shape, cp.dst_list.shape)
            expected = len(comp.entries) * (len(cp.src_list) if comp.kind is StateKind.MAMBA else len(cp.runs))
            assert len(cp.descs) == expected
        execute(tp.descs, src_mem, dst_mem, cover)
    # every destination byte that the plan names was written once, with its source's bytes
    expected_cover = 0
    for t, tp in zip(batch.transfers, plan.transfers):
        pairs = [(s, d, sp, dp) for s, d in zip(src.kv.entries, dst.kv.entries)
                 for sp, dp in zip(tp.src_pages, tp.dst_pages)]
        for sc, dc, cp in zip(src.state, dst.state, tp.state):
            pairs += [(s, d, sp, dp) for s, d in zip(sc.entries, dc.entries) for sp, dp in zip(cp.src_list, cp.dst_list)]
        if tp.last:
            pairs += [(s, d, t.aux_src, t.aux_dst) for s, d in zip(src.aux, dst.aux)]
        for s, d, sp, dp in pairs:
            assert np.array_equal(src_mem.entry_bytes(s, sp), dst_mem.entry_bytes(d, dp))
            assert (cover.entry_bytes(d, dp) == 1).all()
            expected_cover += d.item_len
    assert sum(int(a.sum()) for a in cover.arrays) == expected_cover, "nothing else was written"


@settings(max_examples=60, deadline=None)
@given(scenarios(head_sliced=True))
def test_head_sliced_bytes_land_in_the_right_heads(case):
    shape, batch = case
    plan = plan_reference(batch)
    _check_chunks_tile_requests(batch, plan)
    src, dst = batch.src, batch.dsts[0]
    rng = np.random.default_rng(1)
    src_mem, dst_mem, cover = AddressSpace.of_side(src, rng), AddressSpace.of_side(dst), AddressSpace.of_side(dst)
    ps = shape.page_size
    for tp in plan.transfers:
        assert tp.mode is Mode.HEAD_SLICED
        assert len(tp.kv_descs) == len(src.kv.entries) * len(tp.src_pages) * ps
        execute(tp.kv_descs, src_mem, dst_mem, cover)
    from kvplan.planner.contract.pairing import pair_sides

    hs = pair_sides(src, dst).heads
    lo_s, lo_d, width = hs.src_head * hs.bytes_per_head, hs.dst_head * hs.bytes_per_head, hs.nbytes
    for tp in plan.transfers:
        for s, d in zip(src.kv.entries, dst.kv.entries):
            for sp, dp in zip(tp.src_pages, tp.dst_pages):
                stok = src_mem.entry_bytes(s, sp).reshape(ps, -1)
                dtok = dst_mem.entry_bytes(d, dp).reshape(ps, -1)
                assert np.array_equal(dtok[:, lo_d : lo_d + width], stok[:, lo_s : lo_s + width])
                assert (cover.entry_bytes(d, dp).reshape(ps, -1)[:, lo_d : lo_d + width] == 1).all()
