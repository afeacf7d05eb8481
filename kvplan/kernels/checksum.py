"""Per-request checksums of the bytes a plan moves, keyed by where each byte lands.

The checksum of a set of bytes is ``sum((b + 1) * H(a)) mod 2**32`` over every byte ``b`` that
lands at destination address ``a``, with ``H(a) = ((lo ^ hi * K1) * K2 mod 2**32) | 1`` of the
address's low and high 32 bits. It does not depend on how the bytes are cut into descriptors or
in what order they go, so a sender (from its source bytes and the destination addresses of its
plan) and a receiver (from its destination bytes, over what it published) compute the same value
when, and only when, the same bytes landed at the same places. ``H`` is odd, so any one byte that
differs changes the sum; other corruptions go unseen with a chance of about 2**-32.

**Keyed** (a slot with a key ``(ka, kb)``, 32 bits each): ``H_k(a) = (fmix(lo ^ ka ^ (hi * K1 mod
2**32)) ^ kb) | 1``, with ``fmix`` MurmurHash3's 32-bit finalizer (a bijection whose every output bit
depends on every input bit). Unkeyed, ``H`` is public and nearly linear in the address, so anyone who
writes bytes can pick changes whose terms cancel (adding 1, -1, -1, 1 to four bytes of an aligned
group of four leaves the sum as it was, whatever the bytes). Keyed, the values of ``H_k`` are unknown
to whoever lacks the key: a change of one byte is still always seen, and changes to several bytes
cancel only by chance (of about 2**-24 for the worst changes, whose differences are all multiples of
128; a checksum, not a MAC: each try fails a request). The transport derives a key per request from
the shared secret (:func:`kvplan.transport.auth.checksum_key`).

Shape contract
--------------
* ``descs``: int64 ``[n, 3]`` ``(read_addr, key_addr, nbytes)``: bytes are read from ``read_addr``
  and keyed by ``key_addr`` (a sender: source and destination; a receiver: its own addresses twice).
  Raw device (or, in the interpreter, host) addresses.
* ``owners``: int64 ``[n]``: the slot of ``out`` each descriptor adds to (its request).
* ``keys``: int64 ``[m, 3]`` ``(ka, kb, keyed)`` per slot (optional: none, every slot unkeyed); a
  slot with ``keyed`` 0 sums as the unkeyed checksum, at its speed.
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
F1, F2 = 0x85EBCA6B, 0xC2B2AE35  # MurmurHash3's fmix32 multipliers
BLOCK = 1024
MAX_SPLIT = 64


@triton.jit
def _weights(a, ka, kb, KEYED: tl.constexpr):
    """``H`` (or ``H_k``) of the addresses ``a`` (int64), in 32-bit lanes: every product wraps mod 2**32 as
    the definition asks, and no 64-bit multiply is emulated."""
    lo = (a & 0xFFFFFFFF).to(tl.uint32)
    hi = ((a >> 32) & 0xFFFFFFFF).to(tl.uint32)
    if KEYED:
        x = lo ^ ka ^ (hi * 0x9E3779B1)
        x = x ^ (x >> 16)
        x = x * 0x85EBCA6B
        x = x ^ (x >> 13)
        x = x * 0xC2B2AE35
        x = x ^ (x >> 16)
        h = (x ^ kb) | 1
    else:
        h = ((lo ^ (hi * 0x9E3779B1)) * 0x85EBCA77) | 1
    return h


@triton.jit
def _sum_range(ptr, key, nbytes, part, ka, kb, BLOCK: tl.constexpr, SPLIT: tl.constexpr, KEYED: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.uint32)
    for start in range(part * BLOCK, nbytes, SPLIT * BLOCK):
        o = start + tl.arange(0, BLOCK).to(tl.int64)
        m = o < nbytes
        b = tl.load(ptr + o, mask=m, other=0).to(tl.uint32)
        acc += tl.where(m, (b + 1) * _weights(key + o, ka, kb, KEYED), 0)
    return tl.sum(acc, axis=0)  # (mod 2**32: the lanes wrap, and so does their sum)


@triton.jit
def _checksum_kernel(desc_ptr, owner_ptr, key_ptr, out_ptr, BLOCK: tl.constexpr, SPLIT: tl.constexpr,
                     HAS_KEYS: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    read = tl.load(desc_ptr + i * 3)
    key = tl.load(desc_ptr + i * 3 + 1)
    nbytes = tl.load(desc_ptr + i * 3 + 2)
    owner = tl.load(owner_ptr + i)
    ptr = read.to(tl.pointer_type(tl.uint8))
    if HAS_KEYS:
        ka = (tl.load(key_ptr + owner * 3) & 0xFFFFFFFF).to(tl.uint32)
        kb = (tl.load(key_ptr + owner * 3 + 1) & 0xFFFFFFFF).to(tl.uint32)
        if tl.load(key_ptr + owner * 3 + 2) != 0:
            total = _sum_range(ptr, key, nbytes, part, ka, kb, BLOCK, SPLIT, True)
        else:
            total = _sum_range(ptr, key, nbytes, part, ka, kb, BLOCK, SPLIT, False)
    else:
        total = _sum_range(ptr, key, nbytes, part, 0, 0, BLOCK, SPLIT, False)
    tl.atomic_add(out_ptr + owner, total.to(tl.int64))


def checksum_descriptors(descs: torch.Tensor, owners: torch.Tensor, out: torch.Tensor,
                         typical_bytes: int = 4096, keys: torch.Tensor | None = None) -> None:
    """Add each descriptor's checksum into ``out[owners[i]]`` (see the shape contract), on the
    current stream; ``out`` holds the sums mod 2**32 once the launch has run. ``typical_bytes``
    (a descriptor's size, about) only shapes the grid: any size is summed whole. ``keys``: each
    slot's ``(ka, kb, keyed)`` (``None``: every slot unkeyed).

    Example::

        out = torch.zeros(2, dtype=torch.int64, device="cuda")
        keys = torch.tensor([[ka, kb, 1], [0, 0, 0]], dtype=torch.int64, device="cuda")  # slot 1 unkeyed
        checksum_descriptors(descs, owners, out, typical_bytes=39_290, keys=keys)
    """
    n = descs.shape[0]
    if n == 0:
        return
    if descs.dtype != torch.int64 or owners.dtype != torch.int64 or out.dtype != torch.int64:
        raise TypeError("descs, owners and out must be int64 tensors")
    if keys is not None and (keys.dtype != torch.int64 or keys.shape != (out.shape[0], 3)):
        raise TypeError(f"keys must be an int64 tensor [{out.shape[0]}, 3] (ka, kb, keyed), not {keys.dtype} "
                        f"{tuple(keys.shape)}")
    block, split = launch_shape(typical_bytes)
    _checksum_kernel[(n, split)](descs, owners, out if keys is None else keys, out, BLOCK=block, SPLIT=split,
                                 HAS_KEYS=keys is not None)


def launch_shape(typical_bytes: int) -> tuple[int, int]:
    """``(BLOCK, SPLIT)`` for descriptors of about ``typical_bytes``: few shapes, so that sizes that
    vary from call to call do not compile a kernel each."""
    block = BLOCK if typical_bytes > BLOCK else 256
    split = next(s for s in (1, 8, MAX_SPLIT) if typical_bytes <= 4 * s * block or s == MAX_SPLIT)
    return block, split


def reference_checksum(data: np.ndarray, key_addr: int, key: tuple[int, int] | None = None) -> int:
    """The checksum of the bytes ``data`` landing at ``key_addr, key_addr + 1, ...`` in NumPy (what
    the kernel must equal), under ``key`` ``(ka, kb)`` or unkeyed."""
    M = np.uint64(MASK)
    a = np.uint64(key_addr) + np.arange(len(data), dtype=np.uint64)
    lo, hi = a & M, a >> np.uint64(32)
    if key is None:
        h = (((lo ^ ((hi * np.uint64(K1)) & M)) * np.uint64(K2)) & M) | np.uint64(1)
    else:
        x = lo ^ np.uint64(key[0] & MASK) ^ ((hi * np.uint64(K1)) & M)
        x ^= x >> np.uint64(16)
        x = (x * np.uint64(F1)) & M
        x ^= x >> np.uint64(13)
        x = (x * np.uint64(F2)) & M
        x ^= x >> np.uint64(16)
        h = (x ^ np.uint64(key[1] & MASK)) | np.uint64(1)
    return int((((data.astype(np.uint64) + np.uint64(1)) * h) & M).sum(dtype=np.uint64)) & MASK


COMPILE_SPECS = [
    (_checksum_kernel, {"desc_ptr": "*i64", "owner_ptr": "*i64", "key_ptr": "*i64", "out_ptr": "*i64",
                        "BLOCK": "constexpr", "SPLIT": "constexpr", "HAS_KEYS": "constexpr"},
     {"BLOCK": block, "SPLIT": split, "HAS_KEYS": has_keys})
    for block, split in ((1024, 1), (1024, 8), (1024, 64), (256, 1), (256, 8)) for has_keys in (False, True)
]
