"""Index arrays for NIXL prepared lists: ``entry * num_slots + id`` as int32, entry-major.

Shape contract
--------------
* ``src``, ``dst``: int64 flat paired lists; segment ``s`` is ``[seg_off[s], + seg_n[s])``.
* ``prog_seg``/``prog_off``: program -> (segment, first local index), every segment at least one.
* ``slots``: int64 ``[S, 4]``: ``(entries, src_slots, dst_slots, out_off)``; segment ``s`` writes
  ``out[out_off + e * n + k]`` for ``e < entries``. Grid axis 1 runs over entries.
* ``src_idx``, ``dst_idx``: int32 outputs. The caller guarantees ``entries * slots < 2**31``
  (:func:`kvplan.planner.prepared.prepared_slots`), so the int64 products fit before narrowing.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _prepared_index_kernel(src_ptr, dst_ptr, seg_off_ptr, seg_n_ptr, prog_seg_ptr, prog_off_ptr, slots_ptr,
                           src_idx_ptr, dst_idx_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    seg = tl.load(prog_seg_ptr + pid)
    n = tl.load(seg_n_ptr + seg)
    entries = tl.load(slots_ptr + seg * 4)
    src_slots = tl.load(slots_ptr + seg * 4 + 1)
    dst_slots = tl.load(slots_ptr + seg * 4 + 2)
    out_off = tl.load(slots_ptr + seg * 4 + 3)
    k = tl.load(prog_off_ptr + pid) + tl.arange(0, BLOCK).to(tl.int64)
    m = (k < n) & (e < entries)
    i = tl.load(seg_off_ptr + seg) + k
    s = tl.load(src_ptr + i, mask=m, other=0)
    d = tl.load(dst_ptr + i, mask=m, other=0)
    out = out_off + e * n + k
    tl.store(src_idx_ptr + out, (e * src_slots + s).to(tl.int32), mask=m)
    tl.store(dst_idx_ptr + out, (e * dst_slots + d).to(tl.int32), mask=m)


def prepared_indices(src, dst, seg_off, seg_n, prog_seg, prog_off, slots, src_idx, dst_idx, max_entries: int,
                     block: int) -> None:
    """Fill ``src_idx``/``dst_idx`` (see the module's shape contract)."""
    if prog_seg.numel() == 0 or max_entries == 0:
        return
    _prepared_index_kernel[(prog_seg.numel(), max_entries)](src, dst, seg_off, seg_n, prog_seg, prog_off, slots,
                                                            src_idx, dst_idx, BLOCK=block)


COMPILE_SPECS = [
    (_prepared_index_kernel,
     {"src_ptr": "*i64", "dst_ptr": "*i64", "seg_off_ptr": "*i64", "seg_n_ptr": "*i64", "prog_seg_ptr": "*i64",
      "prog_off_ptr": "*i64", "slots_ptr": "*i64", "src_idx_ptr": "*i32", "dst_idx_ptr": "*i32",
      "BLOCK": "constexpr"},
     {"BLOCK": 1024}),
]
