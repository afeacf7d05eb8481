"""Descriptor expansion (planning.md §5) and NIXL prepared-list indices, over a whole batch.

Both kernels run a fixed grid that loops up to a total read on the device, so one launch (or one
captured graph) serves any batch within its capacity.

Shape contract
--------------
* ``seg`` ``[S, SEG_FIELDS]``; ``seg_sums`` ``[4, S]`` from :mod:`kvplan.kernels.summary`;
  ``head[TOTAL_DESCS]`` / ``head[TOTAL_PREPARED]`` the totals.
* ``src``, ``dst``: int64 element ids; ``run_first``/``run_last`` from
  :mod:`kvplan.kernels.run_table`.
* ``entries``: int64 ``[NE, ENTRY_FIELDS]`` ``(src_base, dst_base, src_item, dst_item, nbytes)``;
  segment ``s`` uses rows ``F_ENTRY_OFF .. + F_ENTRIES``. ``nbytes`` is what a direct descriptor
  moves per item: ``src_item``, or a block of it for the sliced entries of TP-sliced state
  (docs/tp_state.md §4, whose runs are single items). ``heads``: int64 ``[D * K, 5]`` per destination and slot
  (KV, each component, aux) ``(src_token_bytes, dst_token_bytes, src_head_offset, dst_head_offset,
  nbytes)``, read for head-sliced segments.
* :func:`descriptors` writes ``out`` int64 ``[n, 3]`` ``(src_addr, dst_addr, nbytes)``, addresses
  as two's-complement bit patterns of uint64. Segment ``s`` writes its descriptors entry-major:
  direct ``(e, run)``, head-sliced ``(e, element, token)``, where an element (a page, or a unit
  of ``gcd`` tokens between sides of different page sizes) holds ``F_SLICED`` tokens. Lanes own output *words*, so stores
  are contiguous even when ``out`` is pinned host memory written across the bus.
* :func:`prepared_indices` writes ``src_idx``/``dst_idx`` int32: ``e * slots + id`` per entry and
  element of every kept segment; ``slots`` int64 ``[D * K, 2]`` ``(src_slots, dst_slots)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import segments as sg
from .summary import TOTAL_DESCS, TOTAL_PREPARED

HEAD_FIELDS = tl.constexpr(5)
ENTRY_FIELDS = tl.constexpr(5)


@triton.jit
def _descs_kernel(seg_ptr, sums_ptr, head_ptr, src_ptr, dst_ptr, run_first_ptr, run_last_ptr, entries_ptr, heads_ptr,
                  out_ptr, S: tl.constexpr, LOG: tl.constexpr, K: tl.constexpr, SF: tl.constexpr,
                  HF: tl.constexpr, EF: tl.constexpr, BLOCK: tl.constexpr):
    words = tl.load(head_ptr + TOTAL_DESCS) * 3
    stride = tl.num_programs(0).to(tl.int64) * BLOCK
    for base in range(tl.program_id(0).to(tl.int64) * BLOCK, words, stride):
        w = base + tl.arange(0, BLOCK).to(tl.int64)
        live = w < words
        d = w // 3
        col = w - d * 3
        s = tl.where(live, sg.find_segment(sums_ptr + 2 * S, S, d, LOG), 0)
        row_ptr = seg_ptr + s * SF
        n = tl.load(row_ptr + sg.F_N, mask=live, other=1)
        first = tl.load(row_ptr + sg.F_START, mask=live, other=0)
        tokens = tl.load(row_ptr + sg.F_SLICED, mask=live, other=0)  # per element when head-sliced, else 0
        sliced = tokens != 0
        tokens = tl.where(sliced, tokens, 1)
        dest = tl.load(row_ptr + sg.F_DEST, mask=live, other=0)
        entry_off = tl.load(row_ptr + sg.F_ENTRY_OFF, mask=live, other=0)
        entries = tl.load(row_ptr + sg.F_ENTRIES, mask=live, other=0)
        run0 = tl.load(sums_ptr + s, mask=live, other=0)
        runs = tl.load(sums_ptr + S + s, mask=live, other=1)
        per_entry = tl.where(sliced, n * tokens, runs)
        per_entry = tl.where(per_entry > 0, per_entry, 1)
        local = d - (tl.load(sums_ptr + 2 * S + s, mask=live, other=0) - entries * per_entry)
        e = local // per_entry
        r = local - e * per_entry
        ent = entries_ptr + (entry_off + e) * EF
        src_base = tl.load(ent, mask=live, other=0)
        dst_base = tl.load(ent + 1, mask=live, other=0)
        src_item = tl.load(ent + 2, mask=live, other=0)
        dst_item = tl.load(ent + 3, mask=live, other=0)
        per_item = tl.load(ent + 4, mask=live & (col == 2), other=0)
        # direct: run r of the segment
        direct = live & ~sliced
        run_lo = tl.load(run_first_ptr + run0 + r, mask=direct, other=0)
        run_hi = tl.load(run_last_ptr + run0 + r, mask=direct, other=0)
        # head-sliced: element r // tokens, token r % tokens
        tok = r % tokens
        elem = tl.where(sliced, first + r // tokens, run_lo)
        sp = tl.load(src_ptr + elem, mask=live & (col != 1), other=0)
        dp = tl.load(dst_ptr + elem, mask=live & (col == 1), other=0)
        hs = heads_ptr + (dest * K + s % K) * HF
        slice_mask = live & sliced
        src_tok = tl.load(hs, mask=slice_mask, other=0)
        dst_tok = tl.load(hs + 1, mask=slice_mask, other=0)
        src_head = tl.load(hs + 2, mask=slice_mask, other=0)
        dst_head = tl.load(hs + 3, mask=slice_mask, other=0)
        nbytes = tl.load(hs + 4, mask=slice_mask, other=0)
        src_addr = src_base + sp * src_item + tok * src_tok + src_head
        dst_addr = dst_base + dp * dst_item + tok * dst_tok + dst_head
        size = tl.where(sliced, nbytes, (run_hi - run_lo + 1) * per_item)
        tl.store(out_ptr + w, tl.where(col == 0, src_addr, tl.where(col == 1, dst_addr, size)), mask=live)


@triton.jit
def _prepared_kernel(seg_ptr, sums_ptr, head_ptr, src_ptr, dst_ptr, slots_ptr, src_idx_ptr, dst_idx_ptr,
                     S: tl.constexpr, LOG: tl.constexpr, K: tl.constexpr, SF: tl.constexpr, BLOCK: tl.constexpr):
    total = tl.load(head_ptr + TOTAL_PREPARED)
    stride = tl.num_programs(0).to(tl.int64) * BLOCK
    for base in range(tl.program_id(0).to(tl.int64) * BLOCK, total, stride):
        p = base + tl.arange(0, BLOCK).to(tl.int64)
        live = p < total
        s = tl.where(live, sg.find_segment(sums_ptr + 3 * S, S, p, LOG), 0)
        row_ptr = seg_ptr + s * SF
        n = tl.load(row_ptr + sg.F_N, mask=live, other=1)
        n = tl.where(n > 0, n, 1)
        entries = tl.load(row_ptr + sg.F_ENTRIES, mask=live, other=0)
        local = p - (tl.load(sums_ptr + 3 * S + s, mask=live, other=0) - entries * n)
        e = local // n
        elem = tl.load(row_ptr + sg.F_START, mask=live, other=0) + local - e * n
        slot_row = slots_ptr + (tl.load(row_ptr + sg.F_DEST, mask=live, other=0) * K + s % K) * 2
        src_slots = tl.load(slot_row, mask=live, other=0)
        dst_slots = tl.load(slot_row + 1, mask=live, other=0)
        s_id = tl.load(src_ptr + elem, mask=live, other=0)
        d_id = tl.load(dst_ptr + elem, mask=live, other=0)
        tl.store(src_idx_ptr + p, (e * src_slots + s_id).to(tl.int32), mask=live)
        tl.store(dst_idx_ptr + p, (e * dst_slots + d_id).to(tl.int32), mask=live)


def descriptors(seg, seg_sums, head, src, dst, run_first, run_last, entries, heads, out, *,
                segments_per_transfer: int, programs: int, block: int) -> None:
    S = seg.shape[0]
    _descs_kernel[(programs,)](seg, seg_sums, head, src, dst, run_first, run_last, entries, heads, out, S=S,
                               LOG=sg.log2_ceil(S), K=segments_per_transfer, SF=sg.SEG_FIELDS, HF=HEAD_FIELDS,
                               EF=ENTRY_FIELDS, BLOCK=block)


def prepared_indices(seg, seg_sums, head, src, dst, slots, src_idx, dst_idx, *, segments_per_transfer: int,
                     programs: int, block: int) -> None:
    S = seg.shape[0]
    _prepared_kernel[(programs,)](seg, seg_sums, head, src, dst, slots, src_idx, dst_idx, S=S, LOG=sg.log2_ceil(S),
                                  K=segments_per_transfer, SF=sg.SEG_FIELDS, BLOCK=block)


COMPILE_SPECS = [
    (_descs_kernel,
     {"seg_ptr": "*i64", "sums_ptr": "*i64", "head_ptr": "*i64", "src_ptr": "*i64", "dst_ptr": "*i64",
      "run_first_ptr": "*i64", "run_last_ptr": "*i64", "entries_ptr": "*i64", "heads_ptr": "*i64", "out_ptr": "*i64",
      "S": "constexpr", "LOG": "constexpr", "K": "constexpr", "SF": "constexpr", "HF": "constexpr",
      "EF": "constexpr", "BLOCK": "constexpr"},
     {"S": 256, "LOG": 9, "K": 4, "SF": sg.SEG_FIELDS, "HF": HEAD_FIELDS, "EF": ENTRY_FIELDS, "BLOCK": 1024}),
    (_prepared_kernel,
     {"seg_ptr": "*i64", "sums_ptr": "*i64", "head_ptr": "*i64", "src_ptr": "*i64", "dst_ptr": "*i64",
      "slots_ptr": "*i64", "src_idx_ptr": "*i32", "dst_idx_ptr": "*i32", "S": "constexpr", "LOG": "constexpr",
      "K": "constexpr", "SF": "constexpr", "BLOCK": "constexpr"},
     {"S": 256, "LOG": 9, "K": 4, "SF": sg.SEG_FIELDS, "BLOCK": 1024}),
]
