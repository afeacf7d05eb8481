"""Destination addresses moved into this process's mapping of a peer's memory, each descriptor checked
against the regions the peer registered (the ``ipc`` engine's step before its copy).

A descriptor whose bytes ``[dst, dst + nbytes)`` lie inside one region gets its destination moved by
that region's offset (the peer's address to this process's mapping of it). Any other descriptor
(outside every region, straddling two, a negative size, an address past 2**63) is flagged and its
size set to 0, so the copy that follows writes nothing of it.

Shape contract
--------------
* ``descs``: int64 ``[n, 3]`` ``(src, dst, nbytes)``, ``dst`` in the peer's addresses.
* ``regions``: int64 ``[r, 3]`` ``(peer_lo, peer_hi, mapped_lo)``, sorted by ``peer_lo``, disjoint,
  ``r >= 1``; ``STEPS`` the binary search's steps, at least ``ceil(log2(r + 1))``.
* ``out``: int64 ``[n, 3]``: ``(src, mapped dst, nbytes)``, or ``(src, dst, 0)`` for a flagged
  descriptor (may be ``descs`` itself: each program reads its rows before it writes them).
* ``flags``: int8 ``[n]``: 1 where flagged, else 0; ``bad``: int32 ``[1]``, zeroed by the caller:
  the count of flagged descriptors (atomics).
* ``rows`` (optional): int64 ``[1]`` on the device, how many of the ``n`` rows to translate (a plan's
  count, queued behind it without the host knowing it); rows past it are neither read nor written,
  and their ``out`` and ``flags`` stay as they were.
* Grid: ``cdiv(n, BLOCK)``; each lane one descriptor.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "reference_translate", "search_steps", "translate_descriptors"]

BLOCK = 256


@triton.jit(do_not_specialize=["n", "r"])
def _translate_kernel(desc_ptr, region_ptr, out_ptr, flag_ptr, bad_ptr, rows_ptr, n, r, STEPS: tl.constexpr,
                      BLOCK: tl.constexpr, COUNTED: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    if COUNTED:
        n = tl.minimum(tl.load(rows_ptr).to(tl.int64), n)
    live = i < n
    src = tl.load(desc_ptr + i * 3, mask=live, other=0)
    dst = tl.load(desc_ptr + i * 3 + 1, mask=live, other=0)
    nbytes = tl.load(desc_ptr + i * 3 + 2, mask=live, other=0)
    # the last region whose peer_lo <= dst: an upper bound over peer_lo, then one back
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + r
    for _ in tl.static_range(STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        start = tl.load(region_ptr + mid * 3, mask=live & active, other=0)
        below = start <= dst
        lo = tl.where(active & below, mid + 1, lo)
        hi = tl.where(active & ~below, mid, hi)
    k = lo - 1
    found = live & (k >= 0)
    peer_lo = tl.load(region_ptr + k * 3, mask=found, other=0)
    peer_hi = tl.load(region_ptr + k * 3 + 1, mask=found, other=0)
    mapped_lo = tl.load(region_ptr + k * 3 + 2, mask=found, other=0)
    # (dst >= 0 and nbytes >= 0 keep dst + nbytes from wrapping: both are below 2**63)
    inside = found & (dst >= 0) & (nbytes >= 0) & (dst >= peer_lo) & (dst + nbytes <= peer_hi)
    flagged = live & ~inside
    tl.store(out_ptr + i * 3, src, mask=live)
    tl.store(out_ptr + i * 3 + 1, tl.where(inside, dst - peer_lo + mapped_lo, dst), mask=live)
    tl.store(out_ptr + i * 3 + 2, tl.where(inside, nbytes, 0), mask=live)
    tl.store(flag_ptr + i, flagged.to(tl.int8), mask=live)
    tl.atomic_add(bad_ptr + tl.zeros([BLOCK], dtype=tl.int32), flagged.to(tl.int32), mask=live)


def search_steps(regions: int) -> int:
    """The binary search's steps for ``regions`` regions."""
    return max(1, int(regions).bit_length())


def translate_descriptors(descs: torch.Tensor, regions: torch.Tensor, out: torch.Tensor, flags: torch.Tensor,
                          bad: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Launch the translation and check of every descriptor, or of the first ``rows[0]`` (see the
    module's shape contract)."""
    n, r = descs.shape[0], regions.shape[0]
    if n == 0:
        return
    if r == 0:
        raise ValueError("a peer with no registered regions: nothing can be written")
    counted = rows if rows is not None else bad  # (not read unless COUNTED)
    _translate_kernel[(triton.cdiv(n, BLOCK),)](descs, regions, out, flags, bad, counted, n, r, STEPS=search_steps(r),
                                                BLOCK=BLOCK, COUNTED=rows is not None)


def reference_translate(descs: np.ndarray, regions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the kernel computes, in NumPy: ``(out, flags)`` for int64 ``descs`` and ``regions`` (the
    correctness definition the kernel is tested against, and the host path of the ``ipc`` engine)."""
    descs = np.asarray(descs, dtype=np.int64).reshape(-1, 3)
    regions = np.asarray(regions, dtype=np.int64).reshape(-1, 3)
    src, dst, nbytes = descs[:, 0], descs[:, 1], descs[:, 2]
    k = np.searchsorted(regions[:, 0], dst, side="right") - 1
    found = k >= 0
    kk = np.where(found, k, 0)
    peer_lo, peer_hi, mapped_lo = regions[kk, 0], regions[kk, 1], regions[kk, 2]
    with np.errstate(over="ignore"):
        inside = found & (dst >= 0) & (nbytes >= 0) & (dst >= peer_lo) & (dst + nbytes <= peer_hi)
        out = np.stack([src, np.where(inside, dst - peer_lo + mapped_lo, dst), np.where(inside, nbytes, 0)], axis=1)
    return out.astype(np.int64), (~inside).astype(np.int8)


COMPILE_SPECS = [
    (_translate_kernel,
     {"desc_ptr": "*i64", "region_ptr": "*i64", "out_ptr": "*i64", "flag_ptr": "*i8", "bad_ptr": "*i32",
      "rows_ptr": "*i64" if counted else "*i32", "n": "i64", "r": "i64", "STEPS": "constexpr", "BLOCK": "constexpr",
      "COUNTED": "constexpr"},
     {"STEPS": steps, "BLOCK": BLOCK, "COUNTED": counted})
    for steps in (1, 4, 8) for counted in (False, True)
]
