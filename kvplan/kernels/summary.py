"""Per-segment totals of a batch, descriptor offsets, and the verdict on its errors.

One program walks the segments in order with running sums: each segment's runs, its descriptor
count (direct: entries x runs; head-sliced: entries x elements x ``F_SLICED`` tokens) and prepared-index count
(entries x elements of a kept section), their exclusive offsets, the descriptor offsets of every
transfer, and the first transfer whose errors are fatal under the batch's policy.

Shape contract
--------------
* In: ``seg`` ``[S, SEG_FIELDS]``, ``seg_end`` ``[S]``, ``run_id`` ``[N_CAP]``, ``seg_err`` ``[S]``.
* Out: ``seg_sums`` int64 ``[4, S]``: run start, runs, descriptor end (inclusive) and prepared
  end (inclusive) per segment; ``head`` int64 ``[HEAD + T_CAP + 1]``: :data:`HEAD` words
  (``TOTAL_DESCS, TOTAL_RUNS, ELEMENTS, FIRST_FATAL, FIRST_WARN, TOTAL_PREPARED, OVERLAP``, the rest
  0; ``OVERLAP`` is 1 when any segment has ``ERR_OVERLAP``),
  then the descriptor offsets of the transfers ``[T_CAP + 1]``. A missing transfer is ``NONE``;
  ``keep`` int64 ``[S, 2]``: per segment whether it is a section the receiver counts
  (``F_KEEP``) and its element count (``F_N``).

Policy: an unmapped SWA slot is fatal under ``strict`` and a warning under ``truncate``, where
it also excuses the allocator invariant of its segment (planning.md §6).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import segments as sg

HEAD = tl.constexpr(8)
TOTAL_DESCS, TOTAL_RUNS, ELEMENTS, FIRST_FATAL, FIRST_WARN, TOTAL_PREPARED, OVERLAP = (
    tl.constexpr(v) for v in range(7))
NONE = tl.constexpr(1 << 62)


@triton.jit
def _summary_kernel(seg_ptr, seg_end_ptr, run_id_ptr, err_ptr, sums_ptr, head_ptr, keep_ptr, S: tl.constexpr,
                    K: tl.constexpr, STRICT: tl.constexpr, SF: tl.constexpr, BS: tl.constexpr):
    carry_d = tl.zeros([1], dtype=tl.int64).sum(axis=0)
    carry_p = carry_d
    fatal_at = carry_d + NONE
    warn_at = fatal_at
    overlap = carry_d
    for base in range(0, S, BS):
        s = base + tl.arange(0, BS).to(tl.int64)
        live = s < S
        row_ptr = seg_ptr + s * SF
        n = tl.load(row_ptr + sg.F_N, mask=live, other=0)
        first = tl.load(row_ptr + sg.F_START, mask=live, other=0)
        entries = tl.load(row_ptr + sg.F_ENTRIES, mask=live, other=0)
        tokens = tl.load(row_ptr + sg.F_SLICED, mask=live, other=0)  # per element when head-sliced, else 0
        keep = tl.load(row_ptr + sg.F_KEEP, mask=live, other=0)
        before = tl.load(run_id_ptr + first - 1, mask=live & (first > 0), other=0)
        runs = tl.where(n > 0, tl.load(run_id_ptr + first + n - 1, mask=live & (n > 0), other=0) - before, 0)
        descs = entries * tl.where(tokens != 0, n * tokens, runs)
        prepared = entries * n * keep
        desc_end = carry_d + tl.cumsum(descs, axis=0)
        prep_end = carry_p + tl.cumsum(prepared, axis=0)
        tl.store(sums_ptr + s, before, mask=live)
        tl.store(sums_ptr + S + s, runs, mask=live)
        tl.store(sums_ptr + 2 * S + s, desc_end, mask=live)
        tl.store(sums_ptr + 3 * S + s, prep_end, mask=live)
        tl.store(keep_ptr + 2 * s, keep, mask=live)
        tl.store(keep_ptr + 2 * s + 1, n, mask=live)
        tl.store(head_ptr + HEAD + 1 + s // K, desc_end, mask=live & (s % K == K - 1))
        carry_d += tl.sum(descs, axis=0)
        carry_p += tl.sum(prepared, axis=0)

        err = tl.load(err_ptr + s, mask=live, other=0)
        unmapped = (err & sg.ERR_UNMAPPED) != 0
        fatal = (err & sg.ERR_FATAL) != 0
        warn = (err & sg.ERR_WARN) != 0
        if STRICT:
            fatal |= unmapped | ((err & sg.ERR_INVARIANT) != 0)
        else:
            fatal |= ~unmapped & ((err & sg.ERR_INVARIANT) != 0)
            warn |= unmapped
        fatal_at = tl.minimum(fatal_at, tl.min(tl.where(fatal, s // K, NONE), axis=0))
        warn_at = tl.minimum(warn_at, tl.min(tl.where(warn, s // K, NONE), axis=0))
        overlap = tl.maximum(overlap, tl.max(tl.where((err & sg.ERR_OVERLAP) != 0, 1, 0).to(tl.int64), axis=0))
    elements = tl.load(seg_end_ptr + S - 1)
    tl.store(head_ptr + TOTAL_DESCS, carry_d)
    tl.store(head_ptr + TOTAL_RUNS, tl.load(run_id_ptr + elements - 1, mask=elements > 0, other=0))
    tl.store(head_ptr + ELEMENTS, elements)
    tl.store(head_ptr + FIRST_FATAL, fatal_at)
    tl.store(head_ptr + FIRST_WARN, warn_at)
    tl.store(head_ptr + TOTAL_PREPARED, carry_p)
    tl.store(head_ptr + OVERLAP, overlap)
    tl.store(head_ptr + HEAD, carry_d * 0)


def summarize(seg, seg_end, run_id, seg_err, seg_sums, head, keep, *, segments_per_transfer: int,
              strict: bool) -> None:
    """Launch the summary (one program; see the module's shape contract)."""
    S = seg_end.numel()
    _summary_kernel[(1,)](seg, seg_end, run_id, seg_err, seg_sums, head, keep, S=S, K=segments_per_transfer,
                          STRICT=strict, SF=sg.SEG_FIELDS, BS=min(1024, triton.next_power_of_2(S)))


COMPILE_SPECS = [
    (_summary_kernel,
     {"seg_ptr": "*i64", "seg_end_ptr": "*i64", "run_id_ptr": "*i64", "err_ptr": "*i64", "sums_ptr": "*i64",
      "head_ptr": "*i64", "keep_ptr": "*i64", "S": "constexpr", "K": "constexpr", "STRICT": "constexpr",
      "SF": "constexpr", "BS": "constexpr"},
     {"S": 256, "K": 4, "STRICT": True, "SF": sg.SEG_FIELDS, "BS": 256}),
]
