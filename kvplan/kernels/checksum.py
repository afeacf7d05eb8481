"""Per-request checksums of the bytes a plan moves, keyed by where each byte lands.

The checksum of a set of bytes is ``sum((b + 1) * H(a)) mod 2**32`` over every byte ``b`` that
lands at destination address ``a``, with ``H(a) = ((lo ^ hi * K1) * K2 mod 2**32) | 1`` of the
address's low and high 32 bits. It does not depend on how the bytes are cut into descriptors or
in what order they go, so a sender (from its source bytes and the destination addresses of its
plan) and a receiver (from its destination bytes, over what it published) compute the same value
when, and only when, the same bytes landed at the same places. ``H`` is odd, so any one byte that
differs changes the sum; other corruptions go unseen with a chance of about 2**-32.

Shape contract
--------------
* ``descs``: int64 ``[n, 3]`` ``(read_addr, key_addr, nbytes)``: bytes are read from ``read_addr``
  and keyed by ``key_addr`` (a sender: source and destination; a receiver: its own addresses twice).
  Raw device (or, in the interpreter, host) addresses.
* ``owners``: int64 ``[n]``: the slot of ``out`` each descriptor adds to (its request).
* ``out``: int64 ``[m]``, zeroed by the caller; after the launch ``out[k] mod 2**32`` is slot
  ``k``'s checksum (the kernel adds into it with atomics; the sums wrap, the low 32 bits hold).
* Grid: ``(n, SPLIT)``; program ``(i, p)`` reads bytes ``p*BLOCK, p*BLOCK + SPLIT*BLOCK, ...`` of
  descriptor ``i``.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

__all__ = ["MASK", "checksum_descriptors", "launch_shape", "reference_checksum"]

K1, K2, MASK = 0x9E3779B1, 0x85EBCA77, 0xFFFFFFFF
BLOCK = 1024
MAX_SPLIT = 64


@triton.jit
def _checksum_kernel(desc_ptr, owner_ptr, out_ptr, BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    read = tl.load(desc_ptr + i * 3)
    key = tl.load(desc_ptr + i * 3 + 1)
    nbytes = tl.load(desc_ptr + i * 3 + 2)
    owner = tl.load(owner_ptr + i)
    ptr = read.to(tl.pointer_type(tl.uint8))
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(part * BLOCK, nbytes, SPLIT * BLOCK):
        o = start + tl.arange(0, BLOCK).to(tl.int64)
        m = o < nbytes
        b = tl.load(ptr + o, mask=m, other=0).to(tl.int64)
        a = key + o
        lo = a & 0xFFFFFFFF
        hi = (a >> 32) & 0xFFFFFFFF
        h = ((((lo ^ ((hi * 0x9E3779B1) & 0xFFFFFFFF)) * 0x85EBCA77) & 0xFFFFFFFF) | 1)
        acc += tl.where(m, ((b + 1) * h) & 0xFFFFFFFF, 0)
    tl.atomic_add(out_ptr + owner, tl.sum(acc, axis=0))


def checksum_descriptors(descs: torch.Tensor, owners: torch.Tensor, out: torch.Tensor,
                         typical_bytes: int = 4096) -> None:
    """Add each descriptor's checksum into ``out[owners[i]]`` (see the shape contract), on the
    current stream; ``out`` holds the sums mod 2**32 once the launch has run. ``typical_bytes``
    (a descriptor's size, about) only shapes the grid: any size is summed whole."""
    n = descs.shape[0]
    if n == 0:
        return
    if descs.dtype != torch.int64 or owners.dtype != torch.int64 or out.dtype != torch.int64:
        raise TypeError("descs, owners and out must be int64 tensors")
    block, split = launch_shape(typical_bytes)
    _checksum_kernel[(n, split)](descs, owners, out, BLOCK=block, SPLIT=split)


def launch_shape(typical_bytes: int) -> tuple[int, int]:
    """``(BLOCK, SPLIT)`` for descriptors of about ``typical_bytes``: few shapes, so that sizes that
    vary from call to call do not compile a kernel each."""
    block = BLOCK if typical_bytes > BLOCK else 256
    split = next(s for s in (1, 8, MAX_SPLIT) if typical_bytes <= 4 * s * block or s == MAX_SPLIT)
    return block, split


def reference_checksum(data: np.ndarray, key_addr: int) -> int:
    """The checksum of the bytes ``data`` landing at ``key_addr, key_addr + 1, ...`` in NumPy (what
    the kernel must equal)."""
    a = np.uint64(key_addr) + np.arange(len(data), dtype=np.uint64)
    lo, hi = a & np.uint64(MASK), a >> np.uint64(32)
    h = (((lo ^ ((hi * np.uint64(K1)) & np.uint64(MASK))) * np.uint64(K2)) & np.uint64(MASK)) | np.uint64(1)
    return int((((data.astype(np.uint64) + np.uint64(1)) * h) & np.uint64(MASK)).sum(dtype=np.uint64)) & MASK


COMPILE_SPECS = [
    (_checksum_kernel, {"desc_ptr": "*i64", "owner_ptr": "*i64", "out_ptr": "*i64", "BLOCK": "constexpr",
                        "SPLIT": "constexpr"}, {"BLOCK": block, "SPLIT": split})
    for block, split in ((1024, 1), (1024, 8), (1024, 64), (256, 1), (256, 8))
]
