"""Different page sizes on the two sides (docs/page_sizes.md): the reference against the golden
vectors of §8 written by hand, against a token-by-token byte copy on random layouts (direct and
head-sliced); the device planner against the reference; prepared lists refused."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.errors import AlignmentError, DestinationOverlapError, LayoutError
from kvplan.planner.device import eager
from kvplan.planner.device.planner import Planner
from kvplan.planner.contract.batch import Attention, Batch, Entry, KVLayout, SideMemory, Transfer
from kvplan.planner.reference.oracle import plan_reference
from tests.planner.builders import assert_device_matches_reference
from tests.draws import examples

SB, DB, TB = 0x1000_0000, 0x9000_0000, 2  # bases and bytes per token of the one MLA entry


def mla(base, page_size, num_pages, table=None):
    return SideMemory(KVLayout(Attention.MLA, page_size, (Entry(base, page_size * TB, num_pages),)), req_to_token=table)


def slots_table(slots, width=None):
    table = np.zeros((2, width or max(len(slots), 1)), np.int32)
    table[1, : len(slots)] = slots
    return table


def paged_slots(pages, page_size, length):
    return (np.array(pages)[:, None] * page_size + np.arange(page_size)).reshape(-1)[:length]


def transfer(request, dst_pages, fill_len, prompt_len, last, start=0):
    return Transfer(request, src_row=1, start=start, fill_len=fill_len, prompt_len=prompt_len, last=last,
                    dst_pages=np.array(dst_pages, np.int64))


def descs_of(plan):
    return [tuple(int(v) for v in row) for row in plan.descriptors()[0]]


def golden(ps_s, ps_d, src_slots, dst_pages, transfers, width=None):
    src = mla(SB, ps_s, 512, slots_table(src_slots, width))
    return plan_reference(Batch(src, (mla(DB, ps_d, 512),), tuple(transfers)))


def test_a_16_to_64():
    plan = golden(16, 64, paged_slots([5, 6, 9, 10, 11, 2, 3], 16, 112), [3, 4],
                  [transfer("r", [3, 4], 101, 100, True)])
    assert plan.transfers[0].runs.tolist() == [[5, 12, 2], [9, 14, 3], [2, 17, 2]]
    assert descs_of(plan) == [(SB + 160, DB + 384, 64), (SB + 288, DB + 448, 96), (SB + 64, DB + 544, 64)]


def test_b_64_to_16():
    plan = golden(64, 16, paged_slots([7, 3], 64, 128), [1, 2, 3, 8, 9, 4, 5],
                  [transfer("r", [1, 2, 3, 8, 9, 4, 5], 101, 100, True)])
    assert plan.transfers[0].runs.tolist() == [[28, 1, 3], [31, 8, 1], [12, 9, 1], [13, 4, 2]]
    assert descs_of(plan) == [(SB + 896, DB + 32, 96), (SB + 992, DB + 256, 32), (SB + 384, DB + 288, 32),
                              (SB + 416, DB + 128, 64)]


def test_c_1_to_16_chunked():
    slots = list(range(100, 110)) + list(range(50, 80))
    plan = golden(1, 16, slots, [2, 5, 6], [transfer("r", [2, 5, 6], 20, 40, False),
                                            transfer("r", [2, 5, 6], 41, 40, True, start=16)])
    first, second = plan.transfers
    assert (first.end, first.last, second.end, second.last) == (16, False, 40, True)
    assert first.runs.tolist() == [[100, 32, 10], [50, 42, 6]]
    assert second.runs.tolist() == [[56, 80, 24]]
    assert descs_of(plan) == [(SB + 200, DB + 64, 20), (SB + 100, DB + 84, 12), (SB + 112, DB + 160, 48)]


def test_d_256_to_1():
    plan = golden(256, 1, paged_slots([3], 256, 5), [10, 11, 40, 41, 42],
                  [transfer("r", [10, 11, 40, 41, 42], 6, 5, True)], width=256)
    assert plan.transfers[0].runs.tolist() == [[768, 10, 2], [770, 40, 3]]
    assert descs_of(plan) == [(SB + 1536, DB + 20, 4), (SB + 1540, DB + 80, 6)]


def test_e_head_sliced_16_to_64():
    """MHA, 4 KV heads, source TP 2, destination TP 4 rank 1: destination head 0 takes source head 1."""
    src = SideMemory(KVLayout(Attention.MHA, 16, (Entry(SB, 64, 64), Entry(SB + (1 << 20), 64, 64)), num_kv_heads=4,
                              tp_size=2, tp_rank=0), req_to_token=slots_table(paged_slots([4, 9], 16, 32)))
    dst = SideMemory(KVLayout(Attention.MHA, 64, (Entry(DB, 128, 64), Entry(DB + (1 << 20), 128, 64)), num_kv_heads=4,
                              tp_size=4, tp_rank=1))
    plan = plan_reference(Batch(src, (dst,), (transfer("r", [2], 21, 20, True),)))
    descs = descs_of(plan)
    assert len(descs) == 2 * 32  # two entries (K, V) x 32 positions: whole units of 16
    k = descs[:32]
    assert [k[0], k[15], k[16], k[31]] == [(SB + 258, DB + 256, 2), (SB + 318, DB + 286, 2),
                                          (SB + 578, DB + 288, 2), (SB + 638, DB + 318, 2)]
    assert descs[32] == (SB + (1 << 20) + 258, DB + (1 << 20) + 256, 2)


@settings(max_examples=examples(60), deadline=None)
@given(ps_s=st.sampled_from([1, 2, 4, 16, 64]), ps_d=st.sampled_from([1, 2, 4, 16, 64]),
       length=st.integers(1, 300), split=st.floats(0, 1), seed=st.integers(0, 2**31))
def test_every_token_lands_in_its_destination_slot(ps_s, ps_d, length, split, seed):
    """Executing the plan equals copying each position's bytes from its source slot to its destination slot."""
    rng = np.random.default_rng(seed)
    src_pages = rng.permutation(np.arange(1, 512))[: -(-length // ps_s)]
    dst_pages = rng.permutation(np.arange(1, 512))[: -(-length // ps_d)]
    src_slots = paged_slots(src_pages, ps_s, -(-length // ps_s) * ps_s)
    src = mla(0, ps_s, 512, slots_table(src_slots))
    dst = mla(0, ps_d, 512)
    grain = ps_s * ps_d // np.gcd(ps_s, ps_d)
    cut = int(split * length) // grain * grain  # a non-last chunk up to here, when it has tokens
    if -(-cut // ps_d) >= -(-length // ps_d):
        cut = 0  # it would fill every destination page: it would be the last chunk
    transfers = [transfer("r", dst_pages, length + 1, length, True, start=cut)]
    if cut:
        transfers.insert(0, transfer("r", dst_pages, cut, length, False))
    plan = plan_reference(Batch(src, (dst,), tuple(transfers)))
    src_bytes = rng.integers(0, 256, 512 * ps_s * TB, dtype=np.uint8)
    got = np.zeros(512 * ps_d * TB, np.uint8)
    for s, d, n in plan.descriptors()[0].astype(np.int64):
        got[d : d + n] = src_bytes[s : s + n]
    want = np.zeros_like(got)
    for pos in range(length):
        s = int(src_slots[pos]) * TB
        d = (int(dst_pages[pos // ps_d]) * ps_d + pos % ps_d) * TB
        want[d : d + TB] = src_bytes[s : s + TB]
    mine = np.zeros(len(got), bool)  # the request's destination pages: nothing may land elsewhere
    for p in dst_pages:
        mine[p * ps_d * TB : (p + 1) * ps_d * TB] = True
    inside = (np.arange(len(got)) // TB) < 0  # positions < length, by destination slot
    for pos in range(length):
        d = (int(dst_pages[pos // ps_d]) * ps_d + pos % ps_d) * TB
        inside[d : d + TB] = True
    assert np.array_equal(got[inside], want[inside])
    assert not got[~mine].any(), "bytes landed outside the request's destination pages"


def test_a_prefix_off_the_common_grain_is_refused_on_both_paths(device):
    src = mla(SB, 16, 64, slots_table(paged_slots([5, 6, 7, 8], 16, 64)))
    batch = Batch(src, (mla(DB, 64, 64),), (Transfer("r", 1, 16, 65, 64, True, np.array([3]), prefix_len=16),))
    with pytest.raises(AlignmentError, match="least common multiple"):
        plan_reference(batch)
    with pytest.raises(AlignmentError, match="least common multiple"):
        eager.plan(batch.to(device)).check()


def test_the_kernels_refuse_prepared_lists_across_page_sizes(device):
    src = mla(SB, 16, 64, slots_table(paged_slots([5, 6], 16, 32)))
    on_device = Batch(src, (mla(DB, 64, 64),), ()).to(device)
    with pytest.raises(LayoutError, match="prepared lists index whole pages"):
        Planner(on_device.src, on_device.dsts, outputs=("descriptors", "prepared"))


# -- the device planner: the same plans, bit for bit -----------------------------------------------

@pytest.mark.parametrize("vector", [test_a_16_to_64, test_b_64_to_16, test_c_1_to_16_chunked, test_d_256_to_1,
                                    test_e_head_sliced_16_to_64])
def test_the_device_planner_reproduces_the_golden_vectors(device, vector, monkeypatch):
    """Each golden test again, its plans made on the device and checked against the reference's."""
    import tests.planner.test_page_sizes as here

    by_reference = here.plan_reference

    def on_device(batch):
        expected = by_reference(batch)
        pending = eager.plan(batch.to(device))
        pending.result().assert_equal(expected)
        assert np.array_equal(pending.descriptors()[0], expected.descriptors()[0])
        assert pending.sections() == expected.sections()
        return pending.result()

    monkeypatch.setattr(here, "plan_reference", on_device)
    vector()


def sliced_sides(ps_s, ps_d, table, pages=1024, aux=()):
    """MHA with 4 KV heads, source TP 2 rank 0, destination TP 4 rank 1 (golden vector E's heads),
    two entries per side, ``bph = 2``."""
    src = SideMemory(KVLayout(Attention.MHA, ps_s, (Entry(SB, ps_s * 4, pages), Entry(SB + (1 << 24), ps_s * 4, pages)),
                              num_kv_heads=4, tp_size=2, tp_rank=0), aux=aux, req_to_token=table)
    dst = SideMemory(KVLayout(Attention.MHA, ps_d, (Entry(DB, ps_d * 2, pages), Entry(DB + (1 << 24), ps_d * 2, pages)),
                              num_kv_heads=4, tp_size=4, tp_rank=1), aux=tuple(Entry(DB + (1 << 28), e.item_len, e.num_items)
                                                                             for e in aux))
    return src, dst


@settings(max_examples=examples(30), deadline=None)
@given(ps_s=st.sampled_from([1, 4, 16, 64]), ps_d=st.sampled_from([1, 4, 16, 64]), length=st.integers(1, 200),
       seed=st.integers(0, 2**31))
def test_head_sliced_kv_lands_each_position_s_heads(ps_s, ps_d, length, seed):
    """Executing a head-sliced plan between page sizes copies, for every position, the source's head 1
    into the destination's head 0 of that position's slot, in both entries."""
    rng = np.random.default_rng(seed)
    src_pages = rng.permutation(np.arange(1, 256))[: -(-length // ps_s)]
    dst_pages = rng.permutation(np.arange(1, 256))[: -(-length // ps_d)]
    src_slots = paged_slots(src_pages, ps_s, -(-length // ps_s) * ps_s)
    src, dst = sliced_sides(ps_s, ps_d, slots_table(src_slots), pages=256)
    plan = plan_reference(Batch(src, (dst,), (transfer("r", dst_pages, length + 1, length, True),)))
    src_bytes = rng.integers(0, 256, (1 << 24) + 256 * ps_s * 4, dtype=np.uint8)
    got = np.zeros((1 << 24) + 256 * ps_d * 2, np.uint8)
    for s, d, n in plan.descriptors()[0].astype(np.int64):
        got[d - DB : d - DB + n] = src_bytes[s - SB : s - SB + n]
    for entry in (0, 1 << 24):
        for pos in range(length):
            s = entry + int(src_slots[pos]) * 4 + 2  # head 1 of the source's two
            d = entry + (int(dst_pages[pos // ps_d]) * ps_d + pos % ps_d) * 2
            assert got[d : d + 2].tolist() == src_bytes[s : s + 2].tolist(), (entry, pos)


@settings(max_examples=examples(40), deadline=None)
@given(ps_s=st.sampled_from([1, 2, 4, 16, 64]), ps_d=st.sampled_from([1, 2, 4, 16, 64]),
       lens=st.lists(st.integers(1, 200), min_size=1, max_size=3), chunked=st.booleans(), sliced=st.booleans(),
       seed=st.integers(0, 2**31))
def test_the_device_planner_matches_the_reference_on_random_batches(device, ps_s, ps_d, lens, chunked, sliced, seed):
    """Several requests, chunked on the grain, aux rows too, direct (MLA) or head-sliced (MHA, TP 2 ->
    4): plans, descriptors and sections equal."""
    rng = np.random.default_rng(seed)
    grain = ps_s * ps_d // np.gcd(ps_s, ps_d)
    width = max(-(-n // ps_s) * ps_s for n in lens)
    table = np.zeros((len(lens) + 1, width), np.int32)
    src_free = iter(rng.permutation(np.arange(1, 1024)))
    dst_free = iter(rng.permutation(np.arange(1, 1024)))
    transfers = []
    for r, length in enumerate(lens, start=1):
        pages = [next(src_free) for _ in range(-(-length // ps_s))]
        table[r, :length] = paged_slots(pages, ps_s, length)
        dst_pages = np.array([next(dst_free) for _ in range(-(-length // ps_d))], np.int64)
        cut = length // 2 // grain * grain if chunked else 0
        if -(-cut // ps_d) >= len(dst_pages):
            cut = 0
        if cut:
            transfers.append(Transfer(f"q{r}", r, 0, cut, length, False, dst_pages, aux_src=r, aux_dst=r + 3))
        transfers.append(Transfer(f"q{r}", r, cut, length + 1, length, True, dst_pages, aux_src=r, aux_dst=r + 3))
    aux = (Entry(0x7000_0000, 8, 16),)
    if sliced:
        src, dst = sliced_sides(ps_s, ps_d, table, aux=aux)
    else:
        src = SideMemory(KVLayout(Attention.MLA, ps_s, (Entry(SB, ps_s * TB, 1024),
                                                        Entry(SB + (1 << 24), ps_s * TB, 1024))), aux=aux, req_to_token=table)
        dst = SideMemory(KVLayout(Attention.MLA, ps_d, (Entry(DB, ps_d * TB, 1024),
                                                        Entry(DB + (1 << 24), ps_d * TB, 1024))), aux=(Entry(0x7800_0000, 8, 16),))
    batch = Batch(src, (dst,), tuple(transfers))
    assert_device_matches_reference(batch, device)
    # one request given another's destination page: both paths refuse it alike
    if len(transfers) > 1 and transfers[0].request != transfers[-1].request:
        last = transfers[-1]
        stolen = last.dst_pages.copy()
        stolen[0] = transfers[0].dst_pages[0]
        bad = Batch(src, (dst,), tuple(t if t.request != last.request else Transfer(
            t.request, t.src_row, t.start, t.fill_len, t.prompt_len, t.last, stolen, aux_src=t.aux_src,
            aux_dst=t.aux_dst) for t in transfers))
        with pytest.raises(DestinationOverlapError) as by_reference:
            plan_reference(bad)
        with pytest.raises(DestinationOverlapError) as on_device:
            eager.plan(bad.to(device)).check()
        assert str(on_device.value) == str(by_reference.value)


def _check_state_lands(device, preset: str, dst_page_size: int, prefix_len: int, first, dst_slot) -> None:
    """Plan ``preset`` to a destination of ``dst_page_size``, execute the reference's descriptors, and
    check that component 0's bytes of every position ``first(L) <= pos < L`` of each last chunk land at
    ``dst_slot(t, pos, ps_d)``; then the device's plan against the reference."""
    from kvplan.tools.scenarios import PRESETS, build_batch
    from kvplan.tools.verify import AddressSpace, execute

    batch = build_batch(PRESETS[preset].scaled(layers=2), requests=3, prompt_len=[300, 129, 1000], chunks=2,
                        prefix_len=prefix_len, seed=4, dst_page_size=dst_page_size)
    plan = plan_reference(batch)
    src_space = AddressSpace.of_side(batch.src, np.random.default_rng(1))
    dst_space = AddressSpace.of_side(batch.dsts[0])
    execute(plan.descriptors()[0], src_space, dst_space)
    src_comp, dst_comp = batch.src.state[0], batch.dsts[0].state[0]
    ps_s, ps_d = src_comp.pages_of(batch.src.kv.page_size), dst_comp.pages_of(dst_page_size)
    tb = src_comp.entries[0].item_len // ps_s
    full_to_comp = src_comp.slot_map  # SWA translates token slots; DSA pages hold them as they are
    for t in batch.transfers:
        if not t.last:
            continue
        for pos in range(first(src_comp, t.prompt_len), t.prompt_len):
            slot_s = int(batch.src.req_to_token[t.src_row, pos])
            slot_s = int(full_to_comp[slot_s]) if full_to_comp is not None else slot_s
            slot_d = dst_slot(src_comp, t, pos, ps_d)
            for e_s, e_d in zip(src_comp.entries, dst_comp.entries):
                s_arr, s_off = src_space.locate(e_s.base_ptr + slot_s * tb, tb)
                d_arr, d_off = dst_space.locate(e_d.base_ptr + slot_d * tb, tb)
                assert np.array_equal(d_arr[d_off : d_off + tb], s_arr[s_off : s_off + tb]), (t.request, pos)
    pending = eager.plan(batch.to(device))
    pending.result().assert_equal(plan)
    assert np.array_equal(pending.descriptors()[0], plan.descriptors()[0])
    assert pending.sections() == plan.sections()


@pytest.mark.parametrize("dst_page_size", [64, 4, 1])
def test_swa_state_lands_every_attended_position_and_the_device_plans_it_alike(device, dst_page_size):
    """docs/page_sizes.md §6: each side's window start on its own SWA pages; every position the decode
    side attends lands in its published SWA page (executed bytes), then the device against the reference."""

    def window_start(comp, length, ps_d):
        return max(0, length - comp.window) // ps_d * ps_d
    _check_state_lands(device, "gptoss-swa-p16", dst_page_size, 64, lambda comp, length: max(0, length - comp.window),
                       lambda comp, t, pos, ps_d: int(t.dst_state[0][(pos - window_start(comp, t.prompt_len, ps_d))
                                                                     // ps_d]) * ps_d + pos % ps_d)


@pytest.mark.parametrize("dst_page_size", [16, 128, 1])
def test_dsa_state_lands_position_by_position_and_the_device_plans_it_alike(device, dst_page_size):
    """docs/page_sizes.md §6: the indexer's positions [0, L) through each side's own pages, checked per
    position on executed bytes (not against the plan's own lists), then the device against the reference."""
    _check_state_lands(device, "dsv32-mla-dsa-p64", dst_page_size, 128, lambda comp, length: 0,
                       lambda comp, t, pos, ps_d: int(t.dst_state[0][pos // ps_d]) * ps_d + pos % ps_d)
