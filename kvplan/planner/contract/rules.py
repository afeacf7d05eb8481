"""The shared rules of planning.md §2-§4: chunk ends, page sampling, bounds and length checks.

Every planner applies these rules: the NumPy reference (the oracle), the host-side error
reporting of the device planner and the decode side's publication. They raise the exceptions of
:mod:`kvplan.errors`, each naming the request.

Example::

    from kvplan.planner.contract.rules import chunk_end, paired_length
    chunk_end(0, 100, 200, page_size=64, last=False)      # 64: a non-last chunk stops on a page
    paired_length("r1", "KV pages", 4, 4, Policy.STRICT)  # 4; unequal lengths raise
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import AlignmentError, AllocatorInvariantError, InputError, LengthMismatchError, PoolBoundsError
from .batch import Policy

if TYPE_CHECKING:
    from .batch import SideMemory, Transfer

__all__ = [
    "ChunkRange",
    "cdiv",
    "check_aux",
    "check_bounds",
    "check_paged_slots",
    "check_row",
    "check_token_table",
    "chunk_end",
    "host",
    "paired_length",
    "require_both_or_neither",
    "resolve_chunk",
    "token_pages",
]

log = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def host(values: Any) -> np.ndarray:
    """A host NumPy view or copy of an array-like (CPU or CUDA tensor, array, list)."""
    if hasattr(values, "detach"):
        return values.detach().cpu().numpy()
    return np.asarray(values)


def check_token_table(table: Any) -> None:
    """The token table is what every path accepts: a 2-D int32 array or tensor, rows contiguous.

    The reference and the device planner call this alike, so a table one of them accepts is never
    refused (or misread) by the other.
    """
    if table is None:
        raise InputError(None, "the side needs its token table (req_to_token)")
    shape = tuple(getattr(table, "shape", ()))
    dtype = str(getattr(table, "dtype", type(table).__name__)).replace("torch.", "")
    if len(shape) != 2 or dtype != "int32":
        raise InputError(None, f"req_to_token must be a 2-D int32 array or tensor, got {dtype} {shape}")
    unit = table.stride(1) == 1 if hasattr(table, "stride") and callable(table.stride) else table.strides[1] == 4
    if shape[1] > 1 and not unit:
        raise InputError(None, "req_to_token must be row-major (unit column stride); got a column-major or strided "
                         "view: pass .contiguous() / np.ascontiguousarray(...)")


def chunk_end(start: int, fill_len: int, prompt_len: int, page_size: int, last: bool) -> int:
    """Where a chunk starting at ``start`` ends (planning.md §3).

    A non-last chunk stops at the last full page of ``min(fill_len, prompt_len)``; the last chunk
    ends at ``min(fill_len, prompt_len)``, so the sampled token's KV is never sent.

    >>> chunk_end(0, 100, 200, 64, last=False), chunk_end(64, 201, 200, 64, last=True)
    (64, 200)
    """
    seq = min(fill_len, prompt_len)
    return seq if last else max(start, (seq // page_size) * page_size)


def token_pages(table: np.ndarray, row: int, a: int, b: int, page_size: int) -> np.ndarray:
    """``pages(row, a, b)`` of planning.md §2: the page of every ``page_size``-th slot from ``a``."""
    return (table[row, a:b:page_size].astype(np.int64)) // page_size


def check_row(request: Any, table_shape: tuple[int, ...], row: int, end: int) -> None:
    """The row is a real request row (not padding row 0) and ``end`` fits the table."""
    if not 0 < row < table_shape[0]:
        raise InputError(request, f"row {row} is outside the token table's rows [1, {table_shape[0]})")
    if end > table_shape[1]:
        raise InputError(request, f"token {end} is beyond the token table's {table_shape[1]} columns")


def check_bounds(request: Any, what: str, ids: np.ndarray, lowest: int, count: int) -> None:
    """Every id lies in ``[lowest, count)``; the first one outside is named."""
    bad = np.flatnonzero((ids < lowest) | (ids >= count))
    if bad.size:
        k = int(bad[0])
        raise PoolBoundsError(
            request, f"{what} index {int(ids[k])} at position {k} is outside the pool [{lowest}, {count})"
        )


def check_paged_slots(request: Any, what: str, slots: np.ndarray, a: int, page_size: int) -> None:
    """Every slot of positions ``a, a+1, ...`` must equal ``page * ps + pos % ps`` of its page (§2)."""
    pos = np.arange(a, a + slots.size)
    first = slots[(pos - a) // page_size * page_size]
    expected = (first // page_size) * page_size + pos % page_size
    bad = np.flatnonzero(slots != expected)
    if bad.size:
        k = int(bad[0])
        if not slots[k:].any():
            raise AllocatorInvariantError(
                request, f"{what}: the slots of tokens {int(pos[k])} to {int(pos[-1])} are all 0: the row is "
                "unallocated there (SGLang's req_to_token holds 0 where no page was allocated)")
        raise AllocatorInvariantError(
            request,
            f"{what}: slot {int(slots[k])} of token {int(pos[k])} breaks the paged allocator invariant "
            f"(expected {int(expected[k])} for page size {page_size})",
        )


def paired_length(request: Any, what: str, n_src: int, n_dst: int, policy: Policy, always_strict: bool = False) -> int:
    """The common length of two paired lists: an error under strict, else the shorter with a warning."""
    if n_src == n_dst:
        return n_src
    if policy is Policy.STRICT or always_strict:
        raise LengthMismatchError(request, f"{what}: source list has {n_src} entries, destination {n_dst}")
    n = min(n_src, n_dst)
    log.warning("request %r: %s: truncating source %d / destination %d to %d", request, what, n_src, n_dst, n)
    return n


def require_both_or_neither(request: Any, what: str, n_src: int, n_dst: int, policy: Policy) -> bool:
    """Whether two paired lists form runs: exactly one side empty is an error under strict (§4)."""
    if (n_src == 0) != (n_dst == 0) and policy is Policy.STRICT:
        raise LengthMismatchError(request, f"{what}: one side is empty ({n_src} vs {n_dst} entries)")
    return n_src > 0 and n_dst > 0


@dataclass(frozen=True)
class ChunkRange:
    """A chunk resolved from lengths alone (planning.md §3): its end, pages and last-ness."""

    end: int
    pages: int  # source pages sent (after truncation under ``truncate``)
    dst_pages: np.ndarray
    last: bool
    sent: bool


def resolve_chunk(t: "Transfer", page_size: int, table_shape: tuple[int, ...], dst_num_pages: int,
                  policy: Policy) -> ChunkRange:
    """Every check of a chunk that needs no token slot: alignment, ranges, lengths, last flag."""
    ps, request = page_size, t.request
    if t.start % ps:
        raise AlignmentError(request, f"chunk start {t.start} is not a multiple of page size {ps}")
    if t.prefix_len % ps or t.start < t.prefix_len:
        raise AlignmentError(request, f"chunk start {t.start} / decode prefix {t.prefix_len} are inconsistent with page size {ps}")
    end = chunk_end(t.start, t.fill_len, t.prompt_len, ps, t.last)
    if end < t.start:
        raise InputError(request, f"chunk [{t.start}, {end}) is empty or reversed (fill_len {t.fill_len}, prompt {t.prompt_len})")
    check_row(request, table_shape, t.src_row, end)
    n = cdiv(end - t.start, ps)
    total, cursor = len(t.dst_pages), (t.start - t.prefix_len) // ps
    dst_pages = t.dst_pages[cursor : cursor + n]
    what = f"chunk [{t.start}, {end}) KV pages"
    if len(dst_pages) < n:
        if policy is Policy.STRICT:
            raise LengthMismatchError(request, f"{what}: {n} source pages, {len(dst_pages)} destination pages left")
        log.warning("request %r: %s: truncating %d source pages to %d", request, what, n, len(dst_pages))
        n = len(dst_pages)
    check_bounds(request, "destination KV page", dst_pages, 1, dst_num_pages)
    last = cursor + len(dst_pages) >= total
    if last != t.last and policy is Policy.STRICT:
        raise LengthMismatchError(
            request,
            f"{what}: the scheduler says last={t.last} but the destination pages say last={last} "
            f"(cursor {cursor} + {len(dst_pages)} of {total})",
        )
    return ChunkRange(end, n, dst_pages, last, last or n > 0)


def check_aux(t: "Transfer", src: "SideMemory", dst: "SideMemory") -> bool:
    """Whether the last chunk carries aux rows; raises if its aux indices are outside the buffers."""
    if not src.aux:
        return False
    if not 0 <= t.aux_src < min(e.num_items for e in src.aux):
        raise PoolBoundsError(t.request, f"source aux index {t.aux_src} is outside the aux buffers")
    if not 0 <= t.aux_dst < min(e.num_items for e in dst.aux):
        raise PoolBoundsError(t.request, f"destination aux index {t.aux_dst} is outside the aux buffers")
    return True
