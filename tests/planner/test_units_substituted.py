"""Pages moved in units whose source id is substituted or read off the page's first token.

Between different page sizes a paged list moves in units of ``g = gcd(ps_s, ps_d)`` tokens
(docs/page_sizes.md). The reference names each source page by its first token and takes its units
as ``page * (ps / g) + offset``; the device planner must send the same units. Under ``truncate`` an
SWA page with no SWA slot is sent as page 0 *whole* (planning.md §6), not unit 0 of page 0 for every
unit; with ``validate=False`` a page whose later tokens break the allocator invariant is still named
by its first token. Checked on a minimal case, then on random batches of every kind
that moves in units (SWA, DSA, KV), direct and head-sliced.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.planner.contract.batch import (Attention, Batch, Entry, KVLayout, Policy, SideMemory, StateComponent, StateKind,
                                  Transfer)
from tests.planner.builders import assert_device_matches_reference

SB, DB = 0x1000_0000, 0x9000_0000
TB = 2  # bytes per token of every MLA entry


def _mla_side(base, ps, pages, state=(), table=None):
    return SideMemory(KVLayout(Attention.MLA, ps, (Entry(base, ps * TB, pages),)), state=tuple(state),
                      req_to_token=table)


def _swa(base, ps, items, window, slot_map=None):
    return StateComponent(StateKind.SWA, (Entry(base + (1 << 26), ps * TB, items),), window=window,
                          slot_map=slot_map)


def test_an_unmapped_swa_page_is_sent_whole_as_page_0_in_units(device):
    """The issue's minimal case: MLA 16 -> 4, SWA window 32, positions 0-15 unmapped, 16-31 on SWA
    page 5, the decode's SWA items 10-17, truncate: page 0 goes whole (units 0-3 to 10-13)."""
    table = np.zeros((2, 32), np.int32)
    table[1] = np.arange(32) + 16 * 7  # KV pages 7 and 8
    full_to_swa = np.zeros(16 * 16, np.int64)
    full_to_swa[16 * 8 : 16 * 9] = np.arange(16) + 16 * 5  # page 8's tokens -> SWA page 5
    src = _mla_side(SB, 16, 16, [_swa(SB, 16, 16, 32, full_to_swa)], table)
    dst = _mla_side(DB, 4, 64, [_swa(DB, 4, 64, 32)])
    t = Transfer("r", 1, 0, 33, 32, True, np.arange(20, 28), dst_state=(np.arange(10, 18),))
    plan = assert_device_matches_reference(Batch(src, (dst,), (t,), policy=Policy.TRUNCATE), device)
    assert plan.transfers[0].state[0].runs.tolist() == [[0, 10, 4], [20, 14, 4]]


def _random_case(rng, ps_s, ps_d, kind, unmapped_share, lens, sliced):
    """Requests of ``lens`` tokens on random pages; an SWA map with pages left unmapped (or a DSA pool),
    and, when ``unmapped_share`` is 0, pages whose later tokens break the invariant (validate off)."""
    width = max(-(-n // ps_s) * ps_s for n in lens)
    table = np.zeros((len(lens) + 1, width), np.int32)
    free = iter(rng.permutation(np.arange(1, 256)))
    for r, n in enumerate(lens, start=1):
        pages = np.array([next(free) for _ in range(-(-n // ps_s))])
        table[r, :n] = (pages[:, None] * ps_s + np.arange(ps_s)).reshape(-1)[:n]
    if unmapped_share == 0:  # stray tokens inside pages: the reference names a page by its first token
        stray = rng.random(table.shape) < 0.2
        stray[:, ::ps_s] = False
        table[stray] = rng.integers(1, 256 * ps_s, size=int(stray.sum()))
    window = int(rng.integers(1, 4)) * max(ps_s, ps_d)
    if kind is StateKind.SWA:
        swa_pages = rng.permutation(np.arange(1, 256))
        full_to_swa = (swa_pages[:, None] * ps_s + np.arange(ps_s)).reshape(-1)
        full_to_swa = np.concatenate([np.zeros(ps_s, np.int64), full_to_swa]).astype(np.int64)
        dropped = rng.random(256) < unmapped_share
        full_to_swa.reshape(256, ps_s)[dropped] = 0
        comp_s = _swa(SB, ps_s, 256, window, full_to_swa)
        comp_d = _swa(DB, ps_d, 1024, window)
    else:
        comp_s = StateComponent(kind, (Entry(SB + (1 << 26), ps_s * TB, 256),))
        comp_d = StateComponent(kind, (Entry(DB + (1 << 26), ps_d * TB, 1024),))
    if sliced:  # MHA, 2 heads on the source, 1 on each decode rank (TP 1 -> 2), SWA head-sliced alike
        def side(base, ps, pages, comp, heads, tbl=None):
            entries = tuple(Entry(base + i * (1 << 22), ps * heads * 4, pages) for i in range(2))
            # SWA is head-sliced like the KV; DSA's indexer is replicated, so its items stay whole
            per_token = heads * 4 if comp.kind is StateKind.SWA else 4
            # head-sliced SWA pairs only pages of one size (pairing refuses others): ps_s on both sides,
            # so there the KV moves in units and SWA in pages
            comp_ps = ps_s if comp.kind is StateKind.SWA else ps
            comp = StateComponent(comp.kind, (Entry(comp.entries[0].base_ptr, comp_ps * per_token,
                                                    comp.entries[0].num_items),), window=comp.window,
                                  page_size=comp_ps if comp.kind is StateKind.SWA else None, slot_map=comp.slot_map)
            return SideMemory(KVLayout(Attention.MHA, ps, entries, num_kv_heads=2, tp_size=2 // heads,
                                       tp_rank=0), state=(comp,), req_to_token=tbl)
        src = side(SB, ps_s, 256, comp_s, 2, table)
        dst = side(DB, ps_d, 1024, comp_d, 1)
    else:
        src = _mla_side(SB, ps_s, 256, [comp_s], table)
        dst = _mla_side(DB, ps_d, 1024, [comp_d])
    dst_free = iter(rng.permutation(np.arange(1, 1024)))
    state_free = iter(rng.permutation(np.arange(1, 1024)))
    transfers = []
    for r, n in enumerate(lens, start=1):
        dst_pages = np.array([next(dst_free) for _ in range(-(-n // ps_d))], np.int64)
        cps_d = ps_s if sliced and kind is StateKind.SWA else ps_d
        if kind is StateKind.SWA:
            ws = max(0, n - window) // cps_d * cps_d
            count = -(-(n - ws) // cps_d)
        else:
            count = -(-n // cps_d)
        dst_state = np.array([next(state_free) for _ in range(count)], np.int64)
        transfers.append(Transfer(f"q{r}", r, 0, n + 1, n, True, dst_pages, dst_state=(dst_state,)))
    return Batch(src, (dst,), tuple(transfers), policy=Policy.TRUNCATE, validate=unmapped_share > 0)


@settings(max_examples=15, deadline=None)
@given(ps_s=st.sampled_from([1, 2, 4, 16]), ps_d=st.sampled_from([1, 2, 4, 16]),
       kind=st.sampled_from([StateKind.SWA, StateKind.DSA]), unmapped_share=st.sampled_from([0.0, 0.3, 1.0]),
       lens=st.lists(st.integers(1, 64), min_size=1, max_size=2), sliced=st.booleans(),
       seed=st.integers(0, 2**31))
def test_the_device_sends_what_the_reference_sends_for_substituted_pages(device, ps_s, ps_d, kind, unmapped_share,
                                                                           lens, sliced, seed):
    if kind is StateKind.DSA and unmapped_share > 0:
        unmapped_share = 0.0  # DSA has no map: what differs is a page named by its first token
    batch = _random_case(np.random.default_rng(seed), ps_s, ps_d, kind, unmapped_share, lens, sliced)
    assert_device_matches_reference(batch, device)
