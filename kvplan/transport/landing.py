"""Where a peer may write on the receiving side: the bytes of what this side published, nothing else.

A decode side publishes, per request, its destination pages, state slots and aux row. A staged
wave's scatter table comes from the peer; before a byte of it is written, every row ``(dst,
nbytes)`` must lie inside the published ranges of the wave's requests, and the wave must lie
inside the staging buffer. Anything else raises :class:`~kvplan.errors.PeerError`.

Example::

    guard = LandingGuard(side)
    guard.publish("r1", lists, aux_index=3)
    guard.check(["r1"], dst_and_size)        # [n, 2] uint64 rows from the peer
    guard.check_spans([("r1", 0, n)], dst_and_size)   # each request's own rows, checked in one search
    guard.forget("r1")                       # once the request has settled
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from ..errors import PeerError
from ..planner.model import Entry, SideMemory
from ..planner.plan import DestinationLists

__all__ = ["LandingGuard", "merge_ranges"]


def _ranges(entries: tuple[Entry, ...], ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if not entries or len(ids) == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    base = np.array([e.base_ptr for e in entries], np.uint64)[:, None]
    item = np.array([e.item_len for e in entries], np.uint64)[:, None]
    starts = (base + np.asarray(ids, np.uint64)[None, :] * item).reshape(-1)
    return starts, starts + np.broadcast_to(item, (len(entries), len(ids))).reshape(-1)


def merge_ranges(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, disjoint ``[start, end)`` ranges covering the same bytes (touching ranges merge)."""
    if len(starts) == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), bool)
    new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(s)) - 1
    return s[first], reach[last]


def _fits(dst: np.ndarray, size: np.ndarray, end: np.ndarray) -> np.ndarray:
    """``[dst, dst + size)`` ends by ``end``, in arithmetic that cannot wrap: a peer's size near 2**64
    would wrap ``dst + size`` back below ``end`` (uint64)."""
    return (dst < end) & (size <= end - np.minimum(dst, end))


class LandingGuard:
    """The published ranges of every open request on one receiving side."""

    def __init__(self, side: SideMemory):
        self.side = side
        self._ranges: dict[Any, tuple[np.ndarray, np.ndarray]] = {}

    def publish(self, request: Any, lists: DestinationLists, aux_index: int) -> None:
        parts = [_ranges(self.side.kv.entries, lists.pages)]
        parts += [_ranges(c.entries, ids) for c, ids in zip(self.side.state, lists.state)]
        parts.append(_ranges(self.side.aux, np.array([aux_index])))
        self._ranges[request] = merge_ranges(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))

    def forget(self, request: Any) -> None:
        self._ranges.pop(request, None)

    def __len__(self) -> int:
        return len(self._ranges)

    def check(self, requests: Iterable[Any], dst_and_size: np.ndarray) -> None:
        """Raise :class:`PeerError` unless every ``(dst, nbytes)`` row lies in the requests' ranges."""
        requests = list(requests)
        unknown = [r for r in requests if r not in self._ranges]
        if unknown:
            raise PeerError(f"the peer names requests this side has not published (or already settled): {unknown[:4]}")
        rows = np.asarray(dst_and_size, np.uint64).reshape(-1, 2)
        if len(rows) == 0:
            return
        dst, size = rows[:, 0], rows[:, 1]
        inside = np.zeros(len(rows), bool)
        for r in requests:  # each request's ranges were merged once, when it was published
            starts, ends = self._ranges[r]
            at = np.searchsorted(starts, dst, side="right").astype(np.int64) - 1
            hit = (at >= 0) & (size > 0)
            hit[hit] &= _fits(dst[hit], size[hit], ends[at[hit]])
            inside |= hit
        bad = np.flatnonzero(~inside)
        if bad.size:
            k = int(bad[0])
            raise PeerError(f"scatter row {k} writes [{int(dst[k]):#x}, +{int(size[k])}) outside what this side "
                            f"published for requests {requests[:4]}{'...' if len(requests) > 4 else ''}")

    def check_spans(self, spans: Sequence[tuple[Any, int, int]], dst_and_size: np.ndarray) -> None:
        """Raise :class:`PeerError` unless rows ``lo:hi`` of each ``(request, lo, hi)`` lie in that
        request's own ranges: one search over every request's ranges at once (tagged by request in
        the top 16 bits of 64-bit keys, since user-space addresses fit 48 bits), or one search per
        span where an address does not fit."""
        rows = np.asarray(dst_and_size, np.uint64).reshape(-1, 2)
        order = list(dict.fromkeys(r for r, _, _ in spans))
        unknown = [r for r in order if r not in self._ranges]
        if unknown:
            raise PeerError(f"the peer names requests this side has not published (or already settled): {unknown[:4]}")
        if len(rows) == 0:
            return
        dst, size = rows[:, 0], rows[:, 1]
        starts = [self._ranges[r][0] for r in order]
        ends = np.concatenate([self._ranges[r][1] for r in order])
        top = max(int(dst.max()), int(ends.max()) if len(ends) else 0)
        if top >= 1 << 48 or len(order) >= 1 << 15:
            for r, lo, hi in spans:
                self.check([r], rows[lo:hi])
            return
        index = {r: k for k, r in enumerate(order)}
        keys = np.concatenate(starts) | np.repeat(np.arange(len(order), dtype=np.uint64) << np.uint64(48),
                                                 [len(s) for s in starts])
        tags = np.repeat(np.array([index[r] for r, _, _ in spans], np.uint64) << np.uint64(48),
                         [hi - lo for _, lo, hi in spans])
        wanted = dst | tags
        at = np.searchsorted(keys, wanted, side="right").astype(np.int64) - 1
        inside = (at >= 0) & (size > 0)
        hit = at[inside]
        inside[inside] = ((keys[hit] >> np.uint64(48)) == (tags[inside] >> np.uint64(48))) & \
            _fits(dst[inside], size[inside], ends[hit])
        bad = np.flatnonzero(~inside)
        if bad.size:
            k = int(bad[0])
            owner = next(r for r, lo, hi in spans if lo <= k < hi)
            raise PeerError(f"scatter row {k} writes [{int(dst[k]):#x}, +{int(size[k])}) outside what this side "
                            f"published for request {owner!r}")
