"""Different page sizes on the two sides (docs/page_sizes.md): the reference against the golden
vectors of §8 written by hand, against a token-by-token byte copy on random layouts, and the
paths that do not plan it yet refuse it."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.errors import AlignmentError, LayoutError
from kvplan.planner.device import Planner
from kvplan.planner.model import Attention, Batch, Entry, KVLayout, SideMemory, Transfer
from kvplan.planner.reference import plan_reference

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


@settings(max_examples=60, deadline=None)
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


def test_a_prefix_off_the_common_grain_is_refused_and_the_kernels_refuse_the_mismatch(device):
    src = mla(SB, 16, 64, slots_table(paged_slots([5, 6, 7, 8], 16, 64)))
    batch = Batch(src, (mla(DB, 64, 64),), (Transfer("r", 1, 16, 65, 64, True, np.array([3]), prefix_len=16),))
    with pytest.raises(AlignmentError, match="least common multiple"):
        plan_reference(batch)
    with pytest.raises(LayoutError, match="kernels do not yet"):
        on_device = batch.to(device)
        Planner(on_device.src, on_device.dsts)
