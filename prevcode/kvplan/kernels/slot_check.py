"""Validation of the paged allocator invariant (planning.md §2) over token ranges.

Shape contract
--------------
* ``meta``: int64 ``[S, 4]``: ``(row, a, n, page_size)``: tokens ``a .. a+n-1`` of ``row``, ``a``
  page aligned.
* ``prog_seg``/``prog_off``: as in :mod:`kvplan.kernels.index_lists`, over tokens.
* ``table``: int32 token table; ``slot_map``: int64 map applied to every slot first (SWA), or
  ``None``.
* ``errors``: int64 ``[S]``, initialised to ``NO_ERROR``; receives (atomic min) the first local
  token whose slot is not ``page * ps + pos % ps`` of its page's first slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_FIELDS = 4


@triton.jit
def _slot_check_kernel(meta_ptr, prog_seg_ptr, prog_off_ptr, table_ptr, table_stride, map_ptr, map_len, err_ptr,
                       MAPPED: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    seg = tl.load(prog_seg_ptr + pid)
    off = tl.load(prog_off_ptr + pid)
    row = tl.load(meta_ptr + seg * 4)
    a = tl.load(meta_ptr + seg * 4 + 1)
    n = tl.load(meta_ptr + seg * 4 + 2)
    ps = tl.load(meta_ptr + seg * 4 + 3)
    k = off + tl.arange(0, BLOCK).to(tl.int64)
    m = k < n
    line = table_ptr + row * table_stride + a
    slot = tl.load(line + k, mask=m, other=0).to(tl.int64)
    first = tl.load(line + (k // ps) * ps, mask=m, other=0).to(tl.int64)
    if MAPPED:
        ok = (slot >= 0) & (slot < map_len) & (first >= 0) & (first < map_len)
        m = m & ok
        slot = tl.load(map_ptr + slot, mask=m, other=0).to(tl.int64)
        first = tl.load(map_ptr + first, mask=m, other=0).to(tl.int64)
    bad = m & (slot != (first // ps) * ps + k % ps)
    tl.atomic_min(err_ptr + seg, tl.min(tl.where(bad, k, 1 << 62), axis=0))


def check_slots(meta: torch.Tensor, prog_seg: torch.Tensor, prog_off: torch.Tensor, table: torch.Tensor,
                slot_map: torch.Tensor | None, errors: torch.Tensor, block: int) -> None:
    """Launch the check over every program (see the module's shape contract)."""
    if prog_seg.numel() == 0:
        return
    mapped = slot_map is not None
    _slot_check_kernel[(prog_seg.numel(),)](
        meta, prog_seg, prog_off, table, table.stride(0), slot_map if mapped else errors,
        slot_map.numel() if mapped else 0, errors, MAPPED=mapped, BLOCK=block)


COMPILE_SPECS = [
    (_slot_check_kernel,
     {"meta_ptr": "*i64", "prog_seg_ptr": "*i64", "prog_off_ptr": "*i64", "table_ptr": "*i32",
      "table_stride": "i64", "map_ptr": "*i64", "map_len": "i64", "err_ptr": "*i64",
      "MAPPED": "constexpr", "BLOCK": "constexpr"},
     {"MAPPED": mapped, "BLOCK": 1024})
    for mapped in (False, True)
]
