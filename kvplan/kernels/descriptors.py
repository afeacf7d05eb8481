"""Descriptor expansion: direct mode (entry x run) and head-sliced mode (entry x page x token).

Shape contract
--------------
* ``entries``: int64 ``[NE, 4]``: ``(src_base, dst_base, src_item, dst_item)``; segment ``s`` uses
  rows ``seg_entry_off[s] .. + seg_entries[s]``.
* ``src``, ``dst``: int64 flat paired index lists; ``run_elem``, ``run_seg``, ``seg_run_start``
  from :func:`kvplan.kernels.runs.find_runs`.
* ``seg_desc_off``: int64 ``[S]``: first descriptor of each segment; segment ``s`` writes
  ``out[seg_desc_off[s] + e * R_s + r]`` (direct) or ``out[seg_desc_off[s] + e * n_s * ps + k]``
  (head-sliced, token ``k``).
* ``out``: int64 ``[capacity, 3]`` ``(src_addr, dst_addr, nbytes)``, addresses as two's-complement
  bit patterns of uint64 (the host views them as uint64). All address arithmetic is 64-bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

HS_FIELDS = 6  # (page_size, src_token_bytes, dst_token_bytes, src_head_offset, dst_head_offset, nbytes)


@triton.jit
def _direct_descs_kernel(run_elem_ptr, run_seg_ptr, seg_run_start_ptr, num_segs, n_elems, src_ptr, dst_ptr,
                         seg_entry_off_ptr, seg_entries_ptr, seg_desc_off_ptr, entries_ptr, out_ptr,
                         BLOCK: tl.constexpr):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    e = tl.program_id(1).to(tl.int64)
    total = tl.load(seg_run_start_ptr + num_segs)
    m = j < total
    elem = tl.load(run_elem_ptr + j, mask=m, other=0)
    nxt = tl.load(run_elem_ptr + j + 1, mask=m & (j + 1 < total), other=n_elems)
    seg = tl.load(run_seg_ptr + j, mask=m, other=0)
    m = m & (e < tl.load(seg_entries_ptr + seg, mask=m, other=0))
    r0 = tl.load(seg_run_start_ptr + seg, mask=m, other=0)
    runs = tl.load(seg_run_start_ptr + seg + 1, mask=m, other=0) - r0
    out = tl.load(seg_desc_off_ptr + seg, mask=m, other=0) + e * runs + (j - r0)
    ent = entries_ptr + (tl.load(seg_entry_off_ptr + seg, mask=m, other=0) + e) * 4
    src_base = tl.load(ent, mask=m, other=0)
    dst_base = tl.load(ent + 1, mask=m, other=0)
    item = tl.load(ent + 2, mask=m, other=0)
    s0 = tl.load(src_ptr + elem, mask=m, other=0)
    d0 = tl.load(dst_ptr + elem, mask=m, other=0)
    tl.store(out_ptr + out * 3, src_base + s0 * item, mask=m)
    tl.store(out_ptr + out * 3 + 1, dst_base + d0 * item, mask=m)
    tl.store(out_ptr + out * 3 + 2, (nxt - elem) * item, mask=m)


@triton.jit
def _head_sliced_descs_kernel(prog_seg_ptr, prog_off_ptr, seg_off_ptr, seg_n_ptr, hs_ptr, src_ptr, dst_ptr,
                              seg_entry_off_ptr, seg_entries_ptr, seg_desc_off_ptr, entries_ptr, out_ptr,
                              HF: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    seg = tl.load(prog_seg_ptr + pid)
    hs = hs_ptr + seg * HF
    ps = tl.load(hs)
    src_tok = tl.load(hs + 1)
    dst_tok = tl.load(hs + 2)
    src_head = tl.load(hs + 3)
    dst_head = tl.load(hs + 4)
    nbytes = tl.load(hs + 5)
    tokens = tl.load(seg_n_ptr + seg) * ps
    k = tl.load(prog_off_ptr + pid) + tl.arange(0, BLOCK).to(tl.int64)
    m = (k < tokens) & (e < tl.load(seg_entries_ptr + seg))
    elem = tl.load(seg_off_ptr + seg) + k // ps
    t = k % ps
    ent = entries_ptr + (tl.load(seg_entry_off_ptr + seg) + e) * 4
    src_base = tl.load(ent)
    dst_base = tl.load(ent + 1)
    src_item = tl.load(ent + 2)
    dst_item = tl.load(ent + 3)
    sp = tl.load(src_ptr + elem, mask=m, other=0)
    dp = tl.load(dst_ptr + elem, mask=m, other=0)
    out = tl.load(seg_desc_off_ptr + seg) + e * tokens + k
    tl.store(out_ptr + out * 3, src_base + sp * src_item + t * src_tok + src_head, mask=m)
    tl.store(out_ptr + out * 3 + 1, dst_base + dp * dst_item + t * dst_tok + dst_head, mask=m)
    tl.store(out_ptr + out * 3 + 2, nbytes + 0 * k, mask=m)


def direct_descriptors(run_elem, run_seg, seg_run_start, n_elems: int, src, dst, seg_entry_off, seg_entries,
                       seg_desc_off, entries, out, max_runs: int, max_entries: int, block: int) -> None:
    """Expand every run of every direct segment over its entries (one program per block x entry)."""
    if max_runs == 0 or max_entries == 0:
        return
    grid = (triton.cdiv(max_runs, block), max_entries)
    _direct_descs_kernel[grid](run_elem, run_seg, seg_run_start, seg_run_start.numel() - 1, n_elems, src, dst,
                               seg_entry_off, seg_entries, seg_desc_off, entries, out, BLOCK=block)


def head_sliced_descriptors(prog_seg, prog_off, seg_off, seg_n, hs, src, dst, seg_entry_off, seg_entries,
                            seg_desc_off, entries, out, max_entries: int, block: int) -> None:
    """One descriptor per entry x page x token of every head-sliced segment."""
    if prog_seg.numel() == 0 or max_entries == 0:
        return
    grid = (prog_seg.numel(), max_entries)
    _head_sliced_descs_kernel[grid](prog_seg, prog_off, seg_off, seg_n, hs, src, dst, seg_entry_off, seg_entries,
                                    seg_desc_off, entries, out, HF=HS_FIELDS, BLOCK=block)


COMPILE_SPECS = [
    (_direct_descs_kernel,
     {"run_elem_ptr": "*i64", "run_seg_ptr": "*i64", "seg_run_start_ptr": "*i64", "num_segs": "i64",
      "n_elems": "i64", "src_ptr": "*i64", "dst_ptr": "*i64", "seg_entry_off_ptr": "*i64",
      "seg_entries_ptr": "*i64", "seg_desc_off_ptr": "*i64", "entries_ptr": "*i64", "out_ptr": "*i64",
      "BLOCK": "constexpr"},
     {"BLOCK": 256}),
    (_head_sliced_descs_kernel,
     {"prog_seg_ptr": "*i64", "prog_off_ptr": "*i64", "seg_off_ptr": "*i64", "seg_n_ptr": "*i64", "hs_ptr": "*i64",
      "src_ptr": "*i64", "dst_ptr": "*i64", "seg_entry_off_ptr": "*i64", "seg_entries_ptr": "*i64",
      "seg_desc_off_ptr": "*i64", "entries_ptr": "*i64", "out_ptr": "*i64", "HF": "constexpr",
      "BLOCK": "constexpr"},
     {"HF": HS_FIELDS, "BLOCK": 256}),
]
