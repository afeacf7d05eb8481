"""Run boundaries of paired index lists, segmented so that runs never cross segments (planning.md §4).

Shape contract
--------------
* ``src``, ``dst``: int64 ``[N]`` flat paired lists; segment ``s`` is
  ``[seg_off[s], seg_off[s] + seg_n[s])``.
* ``prog_seg``/``prog_off``: program -> (segment, first local index), from
  :func:`kvplan.kernels.index_lists.programs_over`.
* Outputs: ``run_elem`` int64 ``[N]`` (flat index of each run's first element, runs in order),
  ``run_seg`` int64 ``[N]`` (its segment), ``seg_run_start`` int64 ``[S + 1]`` (first run of each
  segment; the last entry is the total), all on the device; only the first ``total`` runs are
  meaningful. Two passes (count, then compact after a device-side scan) keep the output independent
  of program order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _run_flags(src_ptr, dst_ptr, seg_off_ptr, seg_n_ptr, prog_seg_ptr, prog_off_ptr, pid, BLOCK: tl.constexpr):
    seg = tl.load(prog_seg_ptr + pid)
    k = tl.load(prog_off_ptr + pid) + tl.arange(0, BLOCK).to(tl.int64)
    m = k < tl.load(seg_n_ptr + seg)
    i = tl.load(seg_off_ptr + seg) + k
    has_prev = m & (k > 0)
    s = tl.load(src_ptr + i, mask=m, other=0)
    d = tl.load(dst_ptr + i, mask=m, other=0)
    ps = tl.load(src_ptr + i - 1, mask=has_prev, other=0)
    pd = tl.load(dst_ptr + i - 1, mask=has_prev, other=0)
    start = m & ((k == 0) | (s - ps != 1) | (d - pd != 1))
    return seg, i, start


@triton.jit
def _run_count_kernel(src_ptr, dst_ptr, seg_off_ptr, seg_n_ptr, prog_seg_ptr, prog_off_ptr, counts_ptr,
                      BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    seg, i, start = _run_flags(src_ptr, dst_ptr, seg_off_ptr, seg_n_ptr, prog_seg_ptr, prog_off_ptr, pid, BLOCK)
    tl.store(counts_ptr + pid, tl.sum(start.to(tl.int64), axis=0))


@triton.jit
def _run_compact_kernel(src_ptr, dst_ptr, seg_off_ptr, seg_n_ptr, prog_seg_ptr, prog_off_ptr, prog_base_ptr,
                        run_elem_ptr, run_seg_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    seg, i, start = _run_flags(src_ptr, dst_ptr, seg_off_ptr, seg_n_ptr, prog_seg_ptr, prog_off_ptr, pid, BLOCK)
    f = start.to(tl.int64)
    j = tl.load(prog_base_ptr + pid) + tl.cumsum(f, axis=0) - f
    tl.store(run_elem_ptr + j, i, mask=start)
    tl.store(run_seg_ptr + j, seg + 0 * i, mask=start)


def find_runs(src: torch.Tensor, dst: torch.Tensor, seg_off: torch.Tensor, seg_n: torch.Tensor,
              prog_seg: torch.Tensor, prog_off: torch.Tensor, seg_first_prog: torch.Tensor,
              block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(run_elem, run_seg, seg_run_start)``; no host synchronisation."""
    programs = prog_seg.numel()
    counts = torch.empty(programs, dtype=torch.int64, device=src.device)
    grid = (programs,)
    _run_count_kernel[grid](src, dst, seg_off, seg_n, prog_seg, prog_off, counts, BLOCK=block)
    ends = torch.cumsum(counts, 0)
    prog_base = ends - counts
    capacity = max(1, src.numel())
    run_elem = torch.empty(capacity, dtype=torch.int64, device=src.device)
    run_seg = torch.empty(capacity, dtype=torch.int64, device=src.device)
    _run_compact_kernel[grid](src, dst, seg_off, seg_n, prog_seg, prog_off, prog_base, run_elem, run_seg,
                              BLOCK=block)
    seg_run_start = torch.cat([prog_base[seg_first_prog], ends[-1:]])
    return run_elem, run_seg, seg_run_start


_FLAT = {"src_ptr": "*i64", "dst_ptr": "*i64", "seg_off_ptr": "*i64", "seg_n_ptr": "*i64",
         "prog_seg_ptr": "*i64", "prog_off_ptr": "*i64"}
COMPILE_SPECS = [
    (_run_count_kernel, {**_FLAT, "counts_ptr": "*i64", "BLOCK": "constexpr"}, {"BLOCK": 1024}),
    (_run_compact_kernel, {**_FLAT, "prog_base_ptr": "*i64", "run_elem_ptr": "*i64", "run_seg_ptr": "*i64",
                           "BLOCK": "constexpr"}, {"BLOCK": 1024}),
]
