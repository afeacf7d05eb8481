"""Every list element of a batch, and every checked token, over the segment table.

Shape contract
--------------
* ``seg``: int64 ``[S, SEG_FIELDS]`` from :mod:`kvplan.kernels.batch_layout`; ``seg_end``
  ``[S]`` inclusive prefix sums of list lengths (``seg_end[S - 1]`` is the element count ``N``),
  ``chk_end`` ``[S]`` the same over checked tokens.
* ``table``: int32 ``[rows, max_ctx]`` token table (row stride ``table_stride``, unit column
  stride); ``map0..map3``: the slot maps a segment names by ``F_MAP`` (0..3).
* ``dst_flat``: int64 destination lists; element ``k`` of segment ``s`` is
  ``dst_flat[F_DST_LO + k]``, or ``F_DST_LO`` itself when ``F_DST_CONST``.
* :func:`list_elements` writes ``src``/``dst`` ``[N_CAP]`` ids and ``starts`` ``[N_CAP]`` (1 where a
  run starts: a segment's first element, an element of a segment that forms no runs, or a break
  of planning.md §4; 0 past ``N``), and or-s error bits into ``seg_err[s]``.
* Claims (planning.md §6.1): ``own`` int64 ``[D * K, 2]`` gives, per destination and segment slot
  ``k = s % K``, the first bit and the item count of its region of ``claimed``, an int32 bitmap
  that is all zero between plans. Each element with a destination id inside its region sets its
  bit (elements in units: the first unit of each destination page sets the page's bit); one that finds the bit already set or-s ``ERR_OVERLAP`` into ``seg_err[s]``. ``claim_word``
  ``[N_CAP]`` int32 receives the bitmap word each element set (-1 for none), for
  :func:`kvplan.kernels.run_table.compact_runs` to zero once every element has claimed.
* :func:`check_tokens` checks every token of every segment's check range: the allocator
  invariant (ERR_INVARIANT), slot-map bounds and page bounds (ERR_FATAL).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import segments as sg
from .index_lists import element_ids


@triton.jit
def _map_ptr(map_slot, map0_ptr, map1_ptr, map2_ptr, map3_ptr):
    return tl.where(map_slot == 0, map0_ptr, tl.where(map_slot == 1, map1_ptr,
                                                      tl.where(map_slot == 2, map2_ptr, map3_ptr)))


@triton.jit
def _unit_ids(kind, row, a, step, div, ring, k, m, ps, table_ptr, table_stride, maps, map_len):
    """Element ``k`` of a list in units of ``div`` tokens: a paged list's unit at position ``pos = a + k * step``
    is unit ``(pos % ps) // div`` of the page its first token names (``ps``: the list's source page size), so an
    unmapped SWA page (substituted by page 0) is sent whole and a page is read off one token, as in
    :func:`kvplan.planner.reference.expand.unit_lists`; other kinds as :func:`element_ids`."""
    paged = (kind == sg.TOKEN_PAGES) | (kind == sg.MAPPED_PAGES)
    pos = a + k * step
    page_start = pos // ps * ps
    ids, unmapped, map_bad = element_ids(kind, row, tl.where(paged, page_start, a), tl.where(paged, 0, step),
                                         tl.where(paged, ps, div), ring, k, m, table_ptr, table_stride, maps, map_len)
    return tl.where(paged, ids * (ps // div) + (pos % ps) // div, ids), unmapped, map_bad


@triton.jit
def _elements_kernel(seg_ptr, seg_end_ptr, table_ptr, table_stride, map0_ptr, map1_ptr, map2_ptr, map3_ptr,
                     dst_flat_ptr, src_ptr, dst_ptr, starts_ptr, err_ptr, own_ptr, claimed_ptr, claim_word_ptr,
                     N_CAP: tl.constexpr, S: tl.constexpr, K: tl.constexpr, LOG: tl.constexpr, SF: tl.constexpr,
                     UNITS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    total = tl.load(seg_end_ptr + S - 1)
    live = i < total
    s = sg.find_segment(seg_end_ptr, S, i, LOG)
    s = tl.where(live, s, 0)
    row_ptr = seg_ptr + s * SF
    kind = tl.load(row_ptr + sg.F_KIND, mask=live, other=0)
    row = tl.load(row_ptr + sg.F_ROW, mask=live, other=0)
    a = tl.load(row_ptr + sg.F_A, mask=live, other=0)
    step = tl.load(row_ptr + sg.F_STEP, mask=live, other=1)
    div = tl.load(row_ptr + sg.F_DIV, mask=live, other=1)
    ring = tl.load(row_ptr + sg.F_RING, mask=live, other=1)
    dst_lo = tl.load(row_ptr + sg.F_DST_LO, mask=live, other=0)
    dst_const = tl.load(row_ptr + sg.F_DST_CONST, mask=live, other=0) != 0
    lo = tl.load(row_ptr + sg.F_LO, mask=live, other=0)
    hi = tl.load(row_ptr + sg.F_HI, mask=live, other=0)
    dlo = tl.load(row_ptr + sg.F_DLO, mask=live, other=0)
    dhi = tl.load(row_ptr + sg.F_DHI, mask=live, other=0)
    map_slot = tl.load(row_ptr + sg.F_MAP, mask=live, other=-1)
    map_len = tl.load(row_ptr + sg.F_MAP_LEN, mask=live, other=0)
    merge = tl.load(row_ptr + sg.F_MERGE, mask=live, other=0) != 0
    k = i - tl.load(row_ptr + sg.F_START, mask=live, other=0)
    maps = _map_ptr(map_slot, map0_ptr, map1_ptr, map2_ptr, map3_ptr)

    has_prev = live & (k > 0) & merge
    if UNITS:  # a page's units are named by its first token (the reference's rule; an unmapped page is page 0)
        ps = tl.load(row_ptr + sg.F_CHK_PS, mask=live, other=1)
        ids, unmapped, map_bad = _unit_ids(kind, row, a, step, div, ring, k, live, ps, table_ptr, table_stride, maps,
                                           map_len)
        prev, _, _ = _unit_ids(kind, row, a, step, div, ring, k - 1, has_prev, ps, table_ptr, table_stride, maps,
                               map_len)
    else:
        ids, unmapped, map_bad = element_ids(kind, row, a, step, div, ring, k, live, table_ptr, table_stride, maps,
                                             map_len)
        prev, _, _ = element_ids(kind, row, a, step, div, ring, k - 1, has_prev, table_ptr, table_stride, maps,
                                 map_len)
    if UNITS:  # F_RATIO destination units per list entry, from unit F_SKIP of the list (docs/page_sizes.md)
        ratio = tl.load(row_ptr + sg.F_RATIO, mask=live, other=1)
        kk = k + tl.load(row_ptr + sg.F_SKIP, mask=live, other=0)
        dst = tl.load(dst_flat_ptr + dst_lo + kk // ratio, mask=live & ~dst_const, other=0) * ratio + kk % ratio
        prev_dst = (tl.load(dst_flat_ptr + dst_lo + (kk - 1) // ratio, mask=has_prev & ~dst_const, other=0) * ratio
                    + (kk - 1) % ratio)
    else:
        ratio = tl.full([BLOCK], 1, tl.int64)
        kk = k
        dst = tl.load(dst_flat_ptr + dst_lo + k, mask=live & ~dst_const, other=0)
        prev_dst = tl.load(dst_flat_ptr + dst_lo + k - 1, mask=has_prev & ~dst_const, other=0)
    dst = tl.where(dst_const, dst_lo, dst)
    start = live & (~has_prev | (ids - prev != 1) | (dst - prev_dst != 1))

    bad = map_bad | (live & ~unmapped & ((ids < lo) | (ids >= hi))) | (live & ((dst < dlo) | (dst >= dhi)))
    # the destination item this element claims: one bit of its (destination, slot) region; in units,
    # the page, claimed by the segment's first unit in it
    region = own_ptr + (tl.load(row_ptr + sg.F_DEST, mask=live, other=0) * K + s % K) * 2
    items = tl.load(region + 1, mask=live, other=0)
    item = dst // ratio
    claims = live & (dst >= 0) & (item < items) & ((k == 0) | (kk % ratio == 0))
    bit = tl.load(region, mask=claims, other=0) + item
    word = tl.where(claims, bit >> 5, -1)
    one = (tl.full([BLOCK], 1, tl.int32) << (bit & 31).to(tl.int32))
    before = tl.atomic_or(claimed_ptr + word, one, mask=claims)
    again = claims & ((before & one) != 0)

    bits = tl.where(bad, sg.ERR_FATAL, 0) + tl.where(unmapped, sg.ERR_UNMAPPED, 0) + tl.where(again, sg.ERR_OVERLAP, 0)
    tl.atomic_or(err_ptr + s, bits, mask=bits != 0)
    tl.store(claim_word_ptr + i, word.to(tl.int32), mask=i < N_CAP)
    tl.store(src_ptr + i, ids, mask=live)
    tl.store(dst_ptr + i, dst, mask=live)
    tl.store(starts_ptr + i, start.to(tl.int64), mask=i < N_CAP)


@triton.jit
def _check_kernel(seg_ptr, chk_end_ptr, table_ptr, table_stride, map0_ptr, map1_ptr, map2_ptr, map3_ptr, err_ptr,
                  S: tl.constexpr, LOG: tl.constexpr, SF: tl.constexpr, BLOCK: tl.constexpr):
    total = tl.load(chk_end_ptr + S - 1)
    step_all = tl.num_programs(0).to(tl.int64) * BLOCK
    for base in range(tl.program_id(0).to(tl.int64) * BLOCK, total, step_all):
        j = base + tl.arange(0, BLOCK).to(tl.int64)
        live = j < total
        s = tl.where(live, sg.find_segment(chk_end_ptr, S, j, LOG), 0)
        row_ptr = seg_ptr + s * SF
        row = tl.load(row_ptr + sg.F_ROW, mask=live, other=0)
        a = tl.load(row_ptr + sg.F_CHK_A, mask=live, other=0)
        ps = tl.load(row_ptr + sg.F_CHK_PS, mask=live, other=1)
        flags = tl.load(row_ptr + sg.F_CHK_FLAGS, mask=live, other=0)
        lo = tl.load(row_ptr + sg.F_LO, mask=live, other=0)
        hi = tl.load(row_ptr + sg.F_HI, mask=live, other=0)
        map_slot = tl.load(row_ptr + sg.F_MAP, mask=live, other=-1)
        map_len = tl.load(row_ptr + sg.F_MAP_LEN, mask=live, other=0)
        k = j - tl.load(row_ptr + sg.F_CHK_START, mask=live, other=0)
        line = table_ptr + row * table_stride + a
        slot = tl.load(line + k, mask=live, other=0).to(tl.int64)
        first = tl.load(line + k // ps * ps, mask=live, other=0).to(tl.int64)
        mapped = live & ((flags & sg.CHK_MAPPED) != 0)
        map_bad = mapped & ((slot < 0) | (slot >= map_len) | (first < 0) | (first >= map_len))
        maps = _map_ptr(map_slot, map0_ptr, map1_ptr, map2_ptr, map3_ptr)
        use = mapped & ~map_bad
        slot = tl.where(mapped, tl.load(maps + slot, mask=use, other=0).to(tl.int64), slot)
        first = tl.where(mapped, tl.load(maps + first, mask=use, other=0).to(tl.int64), first)
        broken = live & ~map_bad & ((flags & sg.CHK_INVARIANT) != 0) & (slot != first // ps * ps + k % ps)
        page = slot // ps
        out_of_pool = live & ((flags & sg.CHK_PAGE_BOUNDS) != 0) & (k % ps == 0) & ((page < lo) | (page >= hi))
        bits = tl.where(map_bad | out_of_pool, sg.ERR_FATAL, 0) + tl.where(broken, sg.ERR_INVARIANT, 0)
        tl.atomic_or(err_ptr + s, bits, mask=bits != 0)


def _maps(maps: list) -> list:
    return (list(maps) + [maps[0]] * 4)[:4]


def list_elements(seg, seg_end, table, maps, dst_flat, src, dst, starts, seg_err, own, claimed, claim_word, *,
                  segments_per_transfer: int, block: int, units: bool = False) -> None:
    """One program per ``block`` elements of capacity ``src.numel()`` (see the shape contract)."""
    S = seg_end.numel()
    grid = (triton.cdiv(src.numel(), block),)
    _elements_kernel[grid](seg, seg_end, table, table.stride(0), *_maps(maps), dst_flat, src, dst, starts, seg_err,
                           own, claimed, claim_word, N_CAP=src.numel(), S=S, K=segments_per_transfer,
                           LOG=sg.log2_ceil(S), SF=sg.SEG_FIELDS, UNITS=units, BLOCK=block)


def check_tokens(seg, chk_end, table, maps, seg_err, programs: int, block: int) -> None:
    """A fixed grid of ``programs`` looping over every checked token (see the shape contract)."""
    S = chk_end.numel()
    _check_kernel[(programs,)](seg, chk_end, table, table.stride(0), *_maps(maps), seg_err, S=S, LOG=sg.log2_ceil(S),
                               SF=sg.SEG_FIELDS, BLOCK=block)


_MAPS = {"map0_ptr": "*i64", "map1_ptr": "*i64", "map2_ptr": "*i64", "map3_ptr": "*i64"}
COMPILE_SPECS = [
    (_elements_kernel,
     {"seg_ptr": "*i64", "seg_end_ptr": "*i64", "table_ptr": "*i32", "table_stride": "i64", **_MAPS,
      "dst_flat_ptr": "*i64", "src_ptr": "*i64", "dst_ptr": "*i64", "starts_ptr": "*i64", "err_ptr": "*i64",
      "own_ptr": "*i64", "claimed_ptr": "*i32", "claim_word_ptr": "*i32",
      "N_CAP": "constexpr", "S": "constexpr", "K": "constexpr", "LOG": "constexpr", "SF": "constexpr",
      "UNITS": "constexpr", "BLOCK": "constexpr"},
     {"N_CAP": 4096, "S": 256, "K": 4, "LOG": 9, "SF": sg.SEG_FIELDS, "UNITS": units, "BLOCK": 1024})
    for units in (False, True)
]
COMPILE_SPECS += [
    (_check_kernel,
     {"seg_ptr": "*i64", "chk_end_ptr": "*i64", "table_ptr": "*i32", "table_stride": "i64", **_MAPS,
      "err_ptr": "*i64", "S": "constexpr", "LOG": "constexpr", "SF": "constexpr", "BLOCK": "constexpr"},
     {"S": 256, "LOG": 9, "SF": sg.SEG_FIELDS, "BLOCK": 1024}),
]
