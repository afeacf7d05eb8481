"""Runs of a batch (planning.md §4): their first and last elements, and the compact runs form.

Shape contract
--------------
* ``starts``: int64 ``[N_CAP]`` run-start flags from :func:`kvplan.kernels.elements.list_elements`
  (0 past the element count); ``run_id``: its inclusive prefix sum (``torch.cumsum``), so
  ``run_id[N - 1]`` is the run count.
* :func:`compact_runs` writes ``run_first``/``run_last`` ``[N_CAP]``: the first and last element
  of run ``r``. Runs never cross segments because every segment's first element starts a run.
* :func:`compact_runs` also zeroes the claim bitmap words ``claim_word`` names (int32 ``[N_CAP]``,
  -1 for none; see :mod:`kvplan.kernels.elements`): it is the first pass over the elements after
  every element has claimed, so the bitmap is clear again for the next plan without a launch of
  its own.
* :func:`runs_out` writes the compact runs form ``out`` ``[R, 3]`` ``(s0, d0, len)`` (a host
  pinned buffer or a device one), looping over ``R`` read on the device.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _compact_kernel(starts_ptr, run_id_ptr, count_ptr, run_first_ptr, run_last_ptr, claim_word_ptr, claimed_ptr,
                    N_CAP: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    word = tl.load(claim_word_ptr + i, mask=i < N_CAP, other=-1)
    tl.store(claimed_ptr + word, tl.zeros([BLOCK], tl.int32), mask=word >= 0)
    count = tl.load(count_ptr)
    live = i < count
    starts = tl.load(starts_ptr + i, mask=live, other=0) != 0
    run = tl.load(run_id_ptr + i, mask=live, other=0) - 1
    tl.store(run_first_ptr + run, i, mask=live & starts)
    next_starts = (i + 1 == count) | (tl.load(starts_ptr + i + 1, mask=live & (i + 1 < count), other=1) != 0)
    tl.store(run_last_ptr + run, i, mask=live & next_starts)


@triton.jit
def _runs_out_kernel(run_id_ptr, run_first_ptr, run_last_ptr, src_ptr, dst_ptr, out_ptr, N_CAP: tl.constexpr,
                     BLOCK: tl.constexpr):
    words = tl.load(run_id_ptr + N_CAP - 1) * 3
    stride = tl.num_programs(0).to(tl.int64) * BLOCK
    for base in range(tl.program_id(0).to(tl.int64) * BLOCK, words, stride):
        w = base + tl.arange(0, BLOCK).to(tl.int64)
        live = w < words
        r = w // 3
        col = w - r * 3
        first = tl.load(run_first_ptr + r, mask=live, other=0)
        last = tl.load(run_last_ptr + r, mask=live, other=0)
        s0 = tl.load(src_ptr + first, mask=live & (col == 0), other=0)
        d0 = tl.load(dst_ptr + first, mask=live & (col == 1), other=0)
        tl.store(out_ptr + w, tl.where(col == 0, s0, tl.where(col == 1, d0, last - first + 1)), mask=live)


def compact_runs(starts, run_id, count, run_first, run_last, claim_word, claimed, block: int) -> None:
    """``count``: a one-element device tensor holding the element count ``N``."""
    n_cap = starts.numel()
    _compact_kernel[(triton.cdiv(n_cap, block),)](starts, run_id, count, run_first, run_last, claim_word, claimed,
                                                  N_CAP=n_cap, BLOCK=block)


def runs_out(run_id, run_first, run_last, src, dst, out, programs: int, block: int) -> None:
    _runs_out_kernel[(programs,)](run_id, run_first, run_last, src, dst, out, N_CAP=run_id.numel(), BLOCK=block)


COMPILE_SPECS = [
    (_compact_kernel, {"starts_ptr": "*i64", "run_id_ptr": "*i64", "count_ptr": "*i64", "run_first_ptr": "*i64",
                       "run_last_ptr": "*i64", "claim_word_ptr": "*i32", "claimed_ptr": "*i32",
                       "N_CAP": "constexpr", "BLOCK": "constexpr"}, {"N_CAP": 4096, "BLOCK": 1024}),
    (_runs_out_kernel, {"run_id_ptr": "*i64", "run_first_ptr": "*i64", "run_last_ptr": "*i64", "src_ptr": "*i64",
                        "dst_ptr": "*i64", "out_ptr": "*i64", "N_CAP": "constexpr", "BLOCK": "constexpr"},
     {"N_CAP": 4096, "BLOCK": 1024}),
]
