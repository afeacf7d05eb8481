"""Index lists of a batch: KV/DSA page ids, SWA pages through a slot map, ring rows, Mamba slots.

Shape contract
--------------
* ``meta``: int64 ``[S, NUM_FIELDS]``, one row per segment (one list of one transfer), columns
  :data:`FIELDS`. A segment of ``n`` ids writes ``out[out_off : out_off + n]``.
* ``prog_seg``/``prog_off``: int64 ``[P]``: program ``p`` computes ids ``prog_off[p] ..
  prog_off[p] + BLOCK`` of segment ``prog_seg[p]`` (built by :func:`programs_over`; every segment
  has at least one program, so empty segments cost nothing but exist).
* ``table``: int32 ``[rows, max_ctx]`` token table; ``slot_map``: int64 ``[map_len]`` or any
  tensor when no segment of the launch reads a map.
* ``out``: int64 flat ids. ``errors``: int64 ``[S, 2]``, initialised to :data:`NO_ERROR`; column 0
  receives (atomic min) the first id outside ``[lo, hi)`` or map index outside the map, column 1
  the first SWA id whose translated slot is 0.

Kinds: ``TOKEN_PAGES`` ``table[row, a + k*step] // div``; ``MAPPED_PAGES``
``map[table[row, a + k*step]] // div``; ``RING`` ``row * ring + (a + k) % ring``; ``ROW_MAP``
``map[row]``; ``CONST`` ``a``.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .segments import CONST, MAPPED_PAGES, RING, ROW_MAP, TOKEN_PAGES  # noqa: F401  (the list kinds)
FIELDS = ("kind", "row", "a", "step", "div", "ring", "n", "out_off", "lo", "hi", "map_len")  # the columns of meta
NUM_FIELDS = len(FIELDS)
NO_ERROR = 1 << 62


@triton.jit
def element_ids(kind, row, a, step, div, ring, k, m, table_ptr, table_stride, map_ptr, map_len):
    """Element ``k`` of a list by its kind: ``(ids, unmapped, map_bad)``; ``map_ptr`` may differ per lane."""
    reads_table = (kind == 0) | (kind == 1)
    slot = tl.load(table_ptr + row * table_stride + a + k * step, mask=m & reads_table, other=0).to(tl.int64)
    map_index = tl.where(kind == 3, row, slot)
    reads_map = (kind == 1) | (kind == 3)
    map_ok = (map_index >= 0) & (map_index < map_len)
    mapped = tl.load(map_ptr + map_index, mask=m & reads_map & map_ok, other=0).to(tl.int64)
    ring_row = row * ring + (a + k) % ring
    ids = tl.where(kind == 0, slot // div,
                   tl.where(kind == 1, mapped // div,
                            tl.where(kind == 2, ring_row, tl.where(kind == 3, mapped, a))))
    unmapped = m & (kind == 1) & map_ok & (mapped == 0)
    return ids, unmapped, m & reads_map & ~map_ok


@triton.jit
def _index_list_kernel(meta_ptr, prog_seg_ptr, prog_off_ptr, table_ptr, table_stride, map_ptr, out_ptr, err_ptr,
                       NF: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    seg = tl.load(prog_seg_ptr + pid)
    off = tl.load(prog_off_ptr + pid)
    row_meta = meta_ptr + seg * NF
    kind = tl.load(row_meta + 0)
    row = tl.load(row_meta + 1)
    a = tl.load(row_meta + 2)
    step = tl.load(row_meta + 3)
    div = tl.load(row_meta + 4)
    ring = tl.load(row_meta + 5)
    n = tl.load(row_meta + 6)
    out_off = tl.load(row_meta + 7)
    lo = tl.load(row_meta + 8)
    hi = tl.load(row_meta + 9)
    map_len = tl.load(row_meta + 10)

    k = off + tl.arange(0, BLOCK).to(tl.int64)
    m = k < n
    ids, unmapped, map_bad = element_ids(kind, row, a, step, div, ring, k, m, table_ptr, table_stride, map_ptr, map_len)
    bad = map_bad | (m & ~unmapped & ((ids < lo) | (ids >= hi)))
    tl.store(out_ptr + out_off + k, ids, mask=m)
    big = 1 << 62
    tl.atomic_min(err_ptr + seg * 2, tl.min(tl.where(bad, k, big), axis=0))
    tl.atomic_min(err_ptr + seg * 2 + 1, tl.min(tl.where(unmapped, k, big), axis=0))


def programs_over(counts: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Program -> (segment, first local index), at least one program per segment."""
    counts = np.asarray(counts, dtype=np.int64)
    per = np.maximum(1, -(-counts // block))
    seg = np.repeat(np.arange(len(counts), dtype=np.int64), per)
    first = np.cumsum(per) - per
    off = (np.arange(len(seg), dtype=np.int64) - np.repeat(first, per)) * block
    return seg, off


def index_lists(meta: torch.Tensor, prog_seg: torch.Tensor, prog_off: torch.Tensor, table: torch.Tensor,
                slot_map: torch.Tensor | None, out: torch.Tensor, errors: torch.Tensor, block: int) -> None:
    """Launch one program per entry of ``prog_seg`` (see the module's shape contract)."""
    grid = (prog_seg.numel(),)
    if grid[0] == 0:
        return
    _index_list_kernel[grid](meta, prog_seg, prog_off, table, table.stride(0),
                             slot_map if slot_map is not None else out, out, errors,
                             NF=NUM_FIELDS, BLOCK=block)


COMPILE_SPECS = [
    (_index_list_kernel,
     {"meta_ptr": "*i64", "prog_seg_ptr": "*i64", "prog_off_ptr": "*i64", "table_ptr": "*i32",
      "table_stride": "i64", "map_ptr": "*i64", "out_ptr": "*i64", "err_ptr": "*i64",
      "NF": "constexpr", "BLOCK": "constexpr"},
     {"NF": NUM_FIELDS, "BLOCK": 1024}),
]
