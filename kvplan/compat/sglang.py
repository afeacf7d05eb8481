"""SGLang 0.5.14's disaggregation helpers, with the same signatures and results.

These let an SGLang deployment swap its helpers for kvplan's one at a time; the golden vectors of
planning.md §7-8 pin their behaviour. ``group_concurrent_contiguous`` includes the fix of SGLang
PR #27004 (one empty side gives no groups; unequal non-empty lengths raise ``ValueError``).

Example::

    >>> import numpy as np
    >>> kv_to_page_indices(np.array([8, 9, 10, 11, 20, 21, 22, 23, 40, 41]), 4).tolist()
    [2, 5, 10]
    >>> pack_int_lists([[1, 2, 3], [4]], "i").hex()
    '020000000c0000000400000001000000020000000300000004000000'
"""

from __future__ import annotations

import operator
import struct
from typing import Sequence

import numpy as np
import numpy.typing as npt

from ..errors import InputError

__all__ = [
    "group_concurrent_contiguous",
    "kv_to_page_indices",
    "kv_to_page_num",
    "pack_int_lists",
    "pack_list_of_buffers",
    "unpack_int_arrays",
    "unpack_int_lists",
    "unpack_list_of_buffers",
]

# every integer format SGLang's struct-based packing accepts, in its little-endian standard sizes
_FORMATS = {"b": np.dtype("i1"), "B": np.dtype("u1"), "h": np.dtype("<i2"), "H": np.dtype("<u2"),
            "i": np.dtype("<i4"), "I": np.dtype("<u4"), "l": np.dtype("<i4"), "L": np.dtype("<u4"),
            "q": np.dtype("<i8"), "Q": np.dtype("<u8")}


def kv_to_page_indices(kv_indices: npt.NDArray, page_size: int) -> npt.NDArray:
    """Page ids of a slot list: every ``page_size``-th slot divided by ``page_size`` (identity at 1)."""
    if page_size == 1:
        return kv_indices
    return kv_indices[::page_size] // page_size


def kv_to_page_num(num_kv_indices: int, page_size: int) -> int:
    """Pages needed for ``num_kv_indices`` tokens: ``cdiv(n, page_size)``."""
    return (num_kv_indices + page_size - 1) // page_size


def group_concurrent_contiguous(
    src_indices: npt.NDArray, dst_indices: npt.NDArray
) -> tuple[list[list[int]], list[list[int]]]:
    """Split paired index lists into runs where both step by +1 (planning.md §4)."""
    src_indices, dst_indices = np.asarray(src_indices), np.asarray(dst_indices)
    if src_indices.size == 0 or dst_indices.size == 0:
        return [], []
    if src_indices.size != dst_indices.size:
        raise ValueError(f"src_indices has {src_indices.size} entries but dst_indices has {dst_indices.size}")
    brk = np.flatnonzero((np.diff(src_indices) != 1) | (np.diff(dst_indices) != 1)) + 1
    return ([g.tolist() for g in np.split(src_indices, brk)], [g.tolist() for g in np.split(dst_indices, brk)])


def pack_list_of_buffers(buffers: Sequence[bytes]) -> bytes:
    """``u32le n | u32le len_0 .. len_{n-1} | b0 | b1 ...``; an empty list packs to ``b""``."""
    if not buffers:
        return b""
    header = struct.pack(f"<I{len(buffers)}I", len(buffers), *(len(b) for b in buffers))
    return header + b"".join(bytes(b) for b in buffers)


def unpack_list_of_buffers(data: bytes) -> list[bytes]:
    """The inverse of :func:`pack_list_of_buffers`; raises ``InputError`` on a short or long message."""
    data = bytes(data)
    if not data:
        return []
    if len(data) < 4:
        raise InputError(None, f"packed buffer list of {len(data)} bytes has no header")
    (n,) = struct.unpack_from("<I", data)
    body = 4 + 4 * n
    if len(data) < body:
        raise InputError(None, f"packed buffer list announces {n} buffers but holds {len(data)} bytes")
    lengths = struct.unpack_from(f"<{n}I", data, 4)
    if body + sum(lengths) != len(data):
        raise InputError(None, f"packed buffer list: lengths add up to {body + sum(lengths)} bytes, message has {len(data)}")
    out, pos = [], body
    for length in lengths:
        out.append(data[pos : pos + length])
        pos += length
    return out


def _dtype(fmt: str) -> np.dtype:
    try:
        return _FORMATS[fmt]
    except KeyError:
        raise InputError(None, f"unsupported int list format {fmt!r}; use one of {sorted(_FORMATS)}") from None


def pack_int_lists(lists: Sequence[Sequence[int] | npt.NDArray], fmt: str) -> bytes:
    """Pack each inner list as little-endian ``fmt`` integers, then the buffers (planning.md §7).

    Exact over each format's whole range, as SGLang's ``struct`` packing is; a value outside it
    raises ``InputError`` (SGLang raises ``struct.error``).
    """
    dtype = _dtype(fmt)
    return pack_list_of_buffers([_packed(values, fmt, dtype) for values in lists])


def _packed(values: Sequence[int] | npt.NDArray, fmt: str, dtype: np.dtype) -> bytes:
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":  # the fast path, range-checked
        info = np.iinfo(dtype)
        if values.size and (values.min() < info.min or values.max() > info.max):
            raise InputError(None, f"values do not fit the {fmt!r} format ({info.min} to {info.max})")
        return values.astype(dtype, copy=False).tobytes()
    ints = [operator.index(v) for v in values]  # Python ints: exact, even at and above 2**63
    try:
        return struct.pack(f"<{len(ints)}{fmt}", *ints)
    except struct.error as err:
        raise InputError(None, f"values do not fit the {fmt!r} format: {err}") from None


def unpack_int_lists(data: bytes, fmt: str) -> list[list[int]]:
    """The inverse of :func:`pack_int_lists`: one list of Python ints per inner list, as SGLang's."""
    return [arr.tolist() for arr in unpack_int_arrays(data, fmt)]


def unpack_int_arrays(data: bytes, fmt: str) -> list[npt.NDArray]:
    """:func:`unpack_int_lists` as one NumPy array (native byte order) per inner list, for callers
    that compute on them."""
    dtype = _dtype(fmt)
    out = []
    for buf in unpack_list_of_buffers(data):
        if len(buf) % dtype.itemsize:
            raise InputError(None, f"a packed {fmt!r} list of {len(buf)} bytes is not whole items")
        out.append(np.frombuffer(buf, dtype=dtype).astype(dtype.newbyteorder("=")))
    return out
