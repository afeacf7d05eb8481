"""The batch layout on the device: from per-transfer columns to the segment table (planning.md §2, §3, §6).

One program walks the transfers in blocks and, per transfer, resolves its chunk (end, page count,
destination cursor, last-ness, sent), checks everything that lengths alone can show, and writes
the ``K = 2 + C`` segments it owns (KV, each state component, aux; see
:mod:`kvplan.kernels.segments`). Running prefix sums give each segment its first list element and
its first checked token, so no host work depends on the batch's contents.

Shape contract
--------------
* ``cols``: int64 ``[NCOL, T_CAP]`` column-major: the columns of
  :data:`kvplan.planner.device.columns.COLUMNS`, then ``(lo, len)`` per component; ``count_ptr[0]`` is
  the number of live transfers ``T <= T_CAP``.
* ``dest_meta``: int64 ``[D, 6 + 2K + 4C]``: ``(kv_pages, aux_items, sliced_tokens)`` (tokens per
  KV element when head-sliced, else 0; written to ``F_SLICED``), then
  ``(entry_off, entries)`` per slot, then each component's pool size on that destination, then
  each component's ``(page_size, unit)`` there, then each component's sliced tokens (as KV's;
  docs/tp_state.md), then ``(page_size, unit, grain)``: its KV page size,
  ``gcd`` and ``lcm`` with the source's (the last 2C + 3 read only when ``UNITS``: some page size
  differs; docs/page_sizes.md).
* ``comp_meta``: int64 ``[C, COMP_FIELDS]``: ``(kind, window, page_size, ring, num_items, map,
  map_len, always_strict, from_prefix)``; ``kind`` is 0 SWA, 1 DSA, 2 SWA_RING, 3 MAMBA;
  ``from_prefix`` starts SWA and DSA lists no earlier than the transfer's decode prefix.
* Outputs: ``seg`` ``[T_CAP * K, SEG_FIELDS]``; ``seg_end``/``chk_end`` ``[T_CAP * K]``
  (inclusive prefix sums of list lengths and checked tokens); ``seg_err`` ``[T_CAP * K]`` error
  bits (ERR_FATAL on the KV slot for a bad transfer); ``xfer`` ``[T_CAP, 4]``
  ``(end, last, sent, ok)``. Every slot of every transfer up to ``T_CAP`` is written.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import segments as sg

COMP_FIELDS = tl.constexpr(9)
SWA, DSA, SWA_RING, MAMBA = (tl.constexpr(v) for v in range(4))
NCOL_BASE = tl.constexpr(12)  # per-transfer columns before the component pairs
BIG = tl.constexpr(1 << 62)
DEST_FIELDS_BASE = 6  # a destination row's fields besides its 2K entry spans and 4C per-component fields


@triton.jit
def _put(seg_ptr, s, F: tl.constexpr, value, SF: tl.constexpr):
    tl.store(seg_ptr + s * SF + F, value)


@triton.jit
def _write_segment(seg_ptr, err_ptr, s, kind, row, a, step, div, ring, n, dst_lo, dst_const, lo, hi, dlo, dhi,
                   map_slot, map_len, merge, entry_off, entries, sliced, dest, chk_a, chk_ps, chk_flags, chk_n, keep,
                   err, ratio, skip, SF: tl.constexpr):
    _put(seg_ptr, s, 0, kind, SF)
    _put(seg_ptr, s, 1, row, SF)
    _put(seg_ptr, s, 2, a, SF)
    _put(seg_ptr, s, 3, step, SF)
    _put(seg_ptr, s, 4, div, SF)
    _put(seg_ptr, s, 5, ring, SF)
    _put(seg_ptr, s, 6, n, SF)
    _put(seg_ptr, s, 7, dst_lo, SF)
    _put(seg_ptr, s, 8, dst_const, SF)
    _put(seg_ptr, s, 9, lo, SF)
    _put(seg_ptr, s, 10, hi, SF)
    _put(seg_ptr, s, 11, dlo, SF)
    _put(seg_ptr, s, 12, dhi, SF)
    _put(seg_ptr, s, 13, map_slot, SF)
    _put(seg_ptr, s, 14, map_len, SF)
    _put(seg_ptr, s, 15, merge, SF)
    _put(seg_ptr, s, 16, entry_off, SF)
    _put(seg_ptr, s, 17, entries, SF)
    _put(seg_ptr, s, 18, sliced, SF)
    _put(seg_ptr, s, 19, dest, SF)
    _put(seg_ptr, s, 20, chk_a, SF)
    _put(seg_ptr, s, 21, chk_ps, SF)
    _put(seg_ptr, s, 22, chk_flags, SF)
    _put(seg_ptr, s, 23, keep, SF)
    _put(seg_ptr, s, 26, chk_n, SF)
    _put(seg_ptr, s, 27, ratio, SF)
    _put(seg_ptr, s, 28, skip, SF)
    tl.store(err_ptr + s, err)


@triton.jit
def _layout_kernel(cols_ptr, count_ptr, dest_meta_ptr, comp_meta_ptr, seg_ptr, seg_end_ptr, chk_end_ptr, err_ptr,
                   xfer_ptr, rows, max_ctx, src_pages, src_aux_items, num_dests,
                   T_CAP: tl.constexpr, K: tl.constexpr, C: tl.constexpr, PS: tl.constexpr, STRICT: tl.constexpr,
                   VALIDATE: tl.constexpr, HAS_AUX: tl.constexpr, UNITS: tl.constexpr, SF: tl.constexpr,
                   DF: tl.constexpr, CF: tl.constexpr, BT: tl.constexpr):
    count = tl.load(count_ptr)
    carry_n = tl.zeros([1], dtype=tl.int64).sum(axis=0)
    carry_c = carry_n
    for base in range(0, T_CAP, BT):
        t = base + tl.arange(0, BT).to(tl.int64)
        live = t < count
        row = tl.load(cols_ptr + 0 * T_CAP + t, mask=live, other=0)
        start = tl.load(cols_ptr + 1 * T_CAP + t, mask=live, other=0)
        fill = tl.load(cols_ptr + 2 * T_CAP + t, mask=live, other=0)
        prompt = tl.load(cols_ptr + 3 * T_CAP + t, mask=live, other=0)
        prefix = tl.load(cols_ptr + 4 * T_CAP + t, mask=live, other=0)
        flag = tl.load(cols_ptr + 5 * T_CAP + t, mask=live, other=0) != 0
        dest = tl.load(cols_ptr + 6 * T_CAP + t, mask=live, other=0)
        aux_s = tl.load(cols_ptr + 7 * T_CAP + t, mask=live, other=0)
        aux_d = tl.load(cols_ptr + 8 * T_CAP + t, mask=live, other=0)
        n_state = tl.load(cols_ptr + 9 * T_CAP + t, mask=live, other=0)
        kv_lo = tl.load(cols_ptr + 10 * T_CAP + t, mask=live, other=0)
        kv_len = tl.load(cols_ptr + 11 * T_CAP + t, mask=live, other=0)

        # the chunk (planning.md §3) and every check that needs no token slot
        fatal = (dest < 0) | (dest >= num_dests)
        dest = tl.where(fatal, 0, dest)
        dmeta = dest_meta_ptr + dest * DF
        if UNITS:  # docs/page_sizes.md: chunks on the grain lcm(ps_s, ps_d), KV moved in units of gcd
            pd = tl.load(dmeta + DF - 3)
            unit = tl.load(dmeta + DF - 2)
            grain = tl.load(dmeta + DF - 1)
        else:
            pd = PS
            unit = PS
            grain = PS
        fatal |= (start < 0) | (prefix < 0) | (start % grain != 0) | (prefix % grain != 0) | (start < prefix)
        seq = tl.minimum(fill, prompt)
        end = tl.where(flag, seq, tl.maximum(start, seq // grain * grain))
        fatal |= end < start
        fatal |= (row <= 0) | (row >= rows) | (end > max_ctx)
        cursor = tl.maximum(start - prefix, 0) // pd
        if UNITS:
            moved = (end + unit - 1) // unit * unit
            need = tl.where(moved > start, (moved - prefix + pd - 1) // pd - cursor, 0)
        else:
            need = tl.where(end > start, (end - start + PS - 1) // PS, 0)
        avail = tl.maximum(kv_len - cursor, 0)
        short = avail < need
        pages = tl.minimum(need, avail)
        last = cursor + pages >= kv_len
        if UNITS:  # the units the available destination pages hold
            moved = tl.where(short, tl.minimum(moved, prefix + (cursor + pages) * pd), moved)
            n = tl.where(moved > start, (moved - start) // unit, 0)
        else:
            n = pages
        warn = live & (live != live)
        if STRICT:
            fatal |= short | (last != flag)
        else:
            warn |= short
        fatal &= live
        ok = live & ~fatal
        sent = last & ok | (n > 0) & ok
        fatal |= ok & last & (n_state != C)
        ok &= ~fatal
        act = ok & last
        zero = t * 0
        tl.store(xfer_ptr + t * 4, end)
        tl.store(xfer_ptr + t * 4 + 1, last.to(tl.int64))
        tl.store(xfer_ptr + t * 4 + 2, sent.to(tl.int64))
        tl.store(xfer_ptr + t * 4 + 3, ok.to(tl.int64))

        # KV: pages of [start, end); the token range is checked whenever it is not empty
        s = t * K
        checked = ok & (end > start)
        # with units, the element kernel's bounds check of every unit covers the pages' bounds
        chk_flags = tl.where(checked, (0 if UNITS else sg.CHK_PAGE_BOUNDS) + (sg.CHK_INVARIANT if VALIDATE else 0), 0)
        n_kv = tl.where(sent, n, 0)
        sliced = tl.load(dmeta + 2) * sent.to(tl.int64)
        errs = tl.where(fatal, sg.ERR_FATAL, 0) + tl.where(warn & ok, sg.ERR_WARN, 0)
        src_ratio = PS // unit  # units per page on each side (1 and 1 with equal page sizes)
        dst_ratio = pd // unit
        _write_segment(seg_ptr, err_ptr, s, zero + sg.TOKEN_PAGES, row, start, zero + unit, zero + unit, zero + 1,
                       n_kv, kv_lo + cursor, zero, zero + src_ratio, zero + src_pages * src_ratio, zero + dst_ratio,
                       tl.load(dmeta + 0) * dst_ratio, zero - 1, zero, zero + 1, tl.load(dmeta + 3),
                       tl.load(dmeta + 4), sliced, dest, start, zero + PS, chk_flags, tl.where(checked, end - start, 0),
                       sent.to(tl.int64), errs, zero + dst_ratio, zero, SF)
        tot_n = n_kv
        tot_c = tl.where(checked, end - start, 0)

        # state components (planning.md §6), on the last chunk only
        for c in tl.static_range(C):
            cm = comp_meta_ptr + c * CF
            kind = tl.load(cm + 0)
            window = tl.load(cm + 1)
            cps = tl.load(cm + 2)
            ring = tl.load(cm + 3)
            items = tl.load(cm + 4)
            map_slot = tl.load(cm + 5)
            map_len = tl.load(cm + 6)
            always_strict = tl.load(cm + 7) != 0
            floor = tl.where(tl.load(cm + 8) != 0, prefix, 0)  # planning.md §6: SGLang's lists after a prefix
            c_lo = tl.load(cols_ptr + (NCOL_BASE + 2 * c) * T_CAP + t, mask=live, other=0)
            c_len = tl.load(cols_ptr + (NCOL_BASE + 2 * c + 1) * T_CAP + t, mask=live, other=0)
            ws = tl.maximum(seq - window, floor) // cps * cps
            ring_lo = tl.maximum(seq - window, 0)
            a = tl.where(kind == SWA, ws, tl.where(kind == SWA_RING, ring_lo, floor))
            n_src = tl.where(kind == SWA, tl.maximum(seq - ws + cps - 1, 0) // cps,
                             tl.where(kind == DSA, tl.maximum(seq - floor + cps - 1, 0) // cps,
                                      tl.where(kind == SWA_RING, seq - ring_lo, 1)))
            paged = (kind == SWA) | (kind == DSA)
            list_kind = tl.where(kind == SWA, sg.MAPPED_PAGES, tl.where(kind == DSA, sg.TOKEN_PAGES,
                                                                       tl.where(kind == SWA_RING, sg.RING, sg.ROW_MAP)))
            # a paged component whose pages differ on this destination moves in units of their gcd, from
            # the later of both lists' starts (the SWA window start of each side; docs/page_sizes.md §6)
            if UNITS:
                cps_d = tl.load(dmeta + 3 + 2 * K + C + 2 * c)
                cunit = tl.load(dmeta + 4 + 2 * K + C + 2 * c)
                in_units = paged & (cps_d != cps)
            else:
                cps_d = zero + cps
                cunit = zero + cps
                in_units = zero != 0
            c_ratio = tl.where(in_units, cps_d // cunit, 1)
            from_d = tl.where(kind == SWA, tl.maximum(seq - window, floor) // cps_d * cps_d, floor)
            a_units = tl.maximum(a, from_d)
            moved = tl.minimum((seq + cunit - 1) // cunit * cunit, from_d + c_len * cps_d)
            mismatch = act & tl.where(in_units, (seq - from_d + cps_d - 1) // cps_d != c_len, n_src != c_len)
            c_fatal = act & paged & (seq > max_ctx)
            c_warn = act & (act != act)
            if STRICT:
                c_fatal |= mismatch
            else:
                c_fatal |= mismatch & always_strict
                c_warn |= mismatch & ~always_strict
            n_c = tl.where(act, tl.where(in_units, tl.maximum(moved - a_units, 0) // cunit, tl.minimum(n_src, c_len)), 0)
            checked = act & paged & (seq > a)
            # in units, the element kernel's bounds check of every unit covers the pages' bounds
            chk_flags = tl.where(checked, tl.where(kind == SWA, sg.CHK_MAPPED,
                                                   tl.where(in_units, 0, sg.CHK_PAGE_BOUNDS))
                                 + (sg.CHK_INVARIANT if VALIDATE else 0), 0)
            n_chk = tl.where(checked, seq - a, 0)
            step = tl.where(paged, tl.where(in_units, cunit, cps), 1)
            s_ratio = tl.where(in_units, cps // cunit, 1)
            _write_segment(seg_ptr, err_ptr, s + 1 + c, list_kind, row, tl.where(in_units, a_units, a), step, step,
                           tl.where(kind == SWA_RING, ring, 1),
                           n_c, c_lo, zero, tl.where(paged, 1, 0) * s_ratio, items * s_ratio, zero,
                           tl.load(dmeta + 3 + 2 * K + c) * c_ratio,
                           zero + tl.where((kind == SWA) | (kind == MAMBA), map_slot, -1), zero + map_len,
                           zero + tl.where(kind == MAMBA, 0, 1), tl.load(dmeta + 3 + 2 * (1 + c)),
                           tl.load(dmeta + 4 + 2 * (1 + c)), tl.load(dmeta + 3 + 2 * K + 3 * C + c), dest, a,
                           tl.where(paged, cps, 1), chk_flags, n_chk,
                           act.to(tl.int64), tl.where(c_fatal, sg.ERR_FATAL, 0) + tl.where(c_warn, sg.ERR_WARN, 0),
                           c_ratio, tl.where(in_units, (a_units - from_d) // cunit, 0), SF)
            tot_n += n_c
            tot_c += n_chk

        # aux: one row per aux buffer, on the last chunk
        if HAS_AUX:
            aux_bad = act & ((aux_s < 0) | (aux_s >= src_aux_items) | (aux_d < 0) | (aux_d >= tl.load(dmeta + 1)))
            aux_n = tl.where(act & ~aux_bad, 1, 0)
            aux_keep = act.to(tl.int64)
        else:
            aux_bad = act & (act != act)
            aux_n = zero
            aux_keep = zero
        _write_segment(seg_ptr, err_ptr, s + K - 1, zero + sg.CONST, row, aux_s, zero + 1, zero + 1, zero + 1, aux_n,
                       aux_d, zero + 1, zero, zero + BIG, zero, zero + BIG, zero - 1, zero, zero,
                       tl.load(dmeta + 3 + 2 * (K - 1)), tl.load(dmeta + 4 + 2 * (K - 1)), zero, dest, zero, zero + 1,
                       zero, zero, aux_keep, tl.where(aux_bad, sg.ERR_FATAL, 0), zero + 1, zero, SF)
        tot_n += aux_n

        # prefix sums: first element and first checked token of every segment, in segment order
        tl.debug_barrier()
        run_n = carry_n + tl.cumsum(tot_n, axis=0) - tot_n
        run_c = carry_c + tl.cumsum(tot_c, axis=0) - tot_c
        for k in tl.static_range(K):
            seg_n = tl.load(seg_ptr + (s + k) * SF + 6)
            seg_c = tl.load(seg_ptr + (s + k) * SF + 26)
            tl.store(seg_ptr + (s + k) * SF + 24, run_n)
            tl.store(seg_ptr + (s + k) * SF + 25, run_c)
            run_n += seg_n
            run_c += seg_c
            tl.store(seg_end_ptr + s + k, run_n)
            tl.store(chk_end_ptr + s + k, run_c)
        carry_n += tl.sum(tot_n, axis=0)
        carry_c += tl.sum(tot_c, axis=0)


def lay_out(cols, count, dest_meta, comp_meta, seg, seg_end, chk_end, seg_err, xfer, *, rows: int, max_ctx: int,
            src_pages: int, src_aux_items: int, num_dests: int, t_cap: int, components: int, page_size: int,
            strict: bool, validate: bool, has_aux: bool, units: bool = False) -> None:
    """Launch the layout (one program; see the module's shape contract)."""
    K = 2 + components
    _layout_kernel[(1,)](cols, count, dest_meta, comp_meta, seg, seg_end, chk_end, seg_err, xfer, rows, max_ctx,
                         src_pages, src_aux_items, num_dests, T_CAP=t_cap, K=K, C=components, PS=page_size,
                         STRICT=strict, VALIDATE=validate, HAS_AUX=has_aux, UNITS=units, SF=sg.SEG_FIELDS,
                         DF=DEST_FIELDS_BASE + 2 * K + 4 * components, CF=COMP_FIELDS, BT=min(t_cap, 256))


COMPILE_SPECS = [
    (_layout_kernel,
     {"cols_ptr": "*i64", "count_ptr": "*i64", "dest_meta_ptr": "*i64", "comp_meta_ptr": "*i64", "seg_ptr": "*i64",
      "seg_end_ptr": "*i64", "chk_end_ptr": "*i64", "err_ptr": "*i64", "xfer_ptr": "*i64", "rows": "i64",
      "max_ctx": "i64", "src_pages": "i64", "src_aux_items": "i64", "num_dests": "i64", "T_CAP": "constexpr",
      "K": "constexpr", "C": "constexpr", "PS": "constexpr", "STRICT": "constexpr", "VALIDATE": "constexpr",
      "HAS_AUX": "constexpr", "UNITS": "constexpr", "SF": "constexpr", "DF": "constexpr", "CF": "constexpr",
      "BT": "constexpr"},
     {"T_CAP": 64, "K": 4, "C": 2, "PS": 16, "STRICT": True, "VALIDATE": True, "HAS_AUX": True, "UNITS": units,
      "SF": sg.SEG_FIELDS, "DF": DEST_FIELDS_BASE + 8 + 8, "CF": COMP_FIELDS, "BT": 64})
    for units in (False, True)
]
