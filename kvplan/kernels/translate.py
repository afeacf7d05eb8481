"""Destination addresses moved into this process's mapping of a peer's memory, each descriptor checked
against the regions the peer registered: what the ``ipc`` engine's one launch does before each
descriptor's copy (:func:`kvplan.kernels.copy.copy_descriptors` with ``translate``; the kernel is the
copy kernel's, this module defines it in NumPy and is the engine's host path).

A descriptor whose bytes ``[dst, dst + nbytes)`` lie inside one region gets its destination moved by
that region's offset (the peer's address to this process's mapping of it). Any other descriptor
(outside every region, straddling two, a negative size, an address past 2**63) is flagged and its
size set to 0, so the copy that follows writes nothing of it.

Shape contract
--------------
* ``descs``: int64 ``[n, 3]`` ``(src, dst, nbytes)``, ``dst`` in the peer's addresses.
* ``regions``: int64 ``[r, 3]`` ``(peer_lo, peer_hi, mapped_lo)``, sorted by ``peer_lo``, disjoint,
  ``r >= 1``.
* out: int64 ``[n, 3]``: ``(src, mapped dst, nbytes)``, or ``(src, dst, 0)`` for a flagged
  descriptor; flags: int8 ``[n]``, 1 where flagged, else 0.
"""

from __future__ import annotations

import numpy as np

__all__ = ["reference_translate"]


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
