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
    guard.check_notes(spans, dst_and_size, notes)   # what the run's notes claim, against what its rows write
    guard.forget("r1")                       # once the request has settled

A run's section notes are checked too: a KV note may claim, per layer, no more pages than the run's
rows touch there, and a state component's or the aux row's note needs rows that touch it. A sender
that writes one page and claims two is refused, not taken for a complete request.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from ..errors import PeerError
from ..planner.contract.batch import Entry, SideMemory
from ..planner.contract.plan import AUX_ROLE, KV_ROLE, DestinationLists

__all__ = ["LandingGuard", "merge_ranges"]

_TAG = 40  # touched-item keys: a request's index above this bit, an item's place in every entry below it


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
        # every entry (KV, then each component's, then aux), sorted by address, each item a key in one line
        # with a gap between entries (so that touched items of two entries never merge)
        entries = list(side.kv.entries) + [e for c in side.state for e in c.entries] + list(side.aux)
        self._order = np.argsort(np.array([e.base_ptr for e in entries], np.uint64), kind="stable")
        self._bases = np.array([entries[k].base_ptr for k in self._order], np.uint64)
        self._items = np.array([entries[k].item_len for k in self._order], np.uint64)
        self._counts = np.array([entries[k].num_items for k in self._order], np.uint64)
        self._keys = np.concatenate([[0], np.cumsum(self._counts + np.uint64(1))]).astype(np.uint64)

    def publish(self, request: Any, lists: DestinationLists, aux_index: int) -> None:
        parts = [_ranges(self.side.kv.entries, lists.pages)]
        parts += [_ranges(c.entries, ids) for c, ids in zip(self.side.state, lists.state)]
        parts.append(_ranges(self.side.aux, np.array([aux_index])))
        self._ranges[request] = merge_ranges(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))

    def forget(self, request: Any) -> None:
        self._ranges.pop(request, None)

    def ranges(self, request: Any) -> tuple[np.ndarray, np.ndarray]:
        """The request's published bytes: sorted, disjoint ``[starts, ends)`` (uint64)."""
        return self._ranges[request]

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

    def check_notes(self, spans: Sequence[tuple[Any, int, int]], dst_and_size: np.ndarray,
                    notes: Iterable[Any]) -> None:
        """Raise :class:`PeerError` unless the run's rows (already inside what was published, see
        :meth:`check_spans`) write what its section notes claim (:class:`~.completion.SectionNote`),
        request by request: a KV note's pages at most the pages the rows touch in each layer it
        covers (all notes of the run added up), a state component's note only where the rows touch
        its items in the layers it covers, an aux note only where they touch the aux row."""
        notes = list(notes)
        if not notes:
            return
        order = list(dict.fromkeys(r for r, _, _ in spans))
        touched = self._touched(order, spans, np.asarray(dst_and_size, np.uint64).reshape(-1, 2))
        index = {r: k for k, r in enumerate(order)}
        kv = self.side.kv
        layers = np.asarray(kv.model_layers, np.int64)
        parts = len(kv.entries) // max(1, len(layers))
        claims = np.zeros((len(order), len(layers)), np.int64)
        for note in notes:
            k = index.get(note.request)
            if k is None:
                raise PeerError(f"a section note names request {note.request!r}, which the run's table does not")
            covered = np.ones(len(layers), bool) if note.layers is None else \
                (layers >= note.layers[0]) & (layers < note.layers[1])
            if note.role == KV_ROLE:
                claims[k, covered] += note.count
            elif not self._written(note, touched[k]):
                raise PeerError(f"request {note.request!r}: a note says its {note.name!r} landed, but the run's rows "
                                "write none of it")
        at = len(kv.entries)
        kv_pages = touched[:, :at].reshape(len(order), parts, len(layers)).min(axis=1) if at else claims * 0
        over = np.argwhere(claims > kv_pages)
        if len(over):
            k, layer = (int(x) for x in over[0])
            raise PeerError(f"request {order[k]!r}: its notes claim {int(claims[k, layer])} KV pages of layer "
                            f"{int(layers[layer])}, but the run's rows write {int(kv_pages[k, layer])}")

    def _touched(self, order: list, spans: Sequence[tuple[Any, int, int]], rows: np.ndarray) -> np.ndarray:
        """Distinct items each request's rows touch, per entry (KV, components, aux: ``engine_regions``
        order), ``[requests, entries]``."""
        touched = np.zeros((len(order), len(self._bases)), np.int64)
        if len(rows) == 0 or len(self._bases) == 0:
            return touched
        index = {r: k for k, r in enumerate(order)}
        tags = np.repeat(np.array([index[r] for r, _, _ in spans], np.uint64), [hi - lo for _, lo, hi in spans])
        dst, size = rows[:, 0], rows[:, 1]
        at = np.clip(np.searchsorted(self._bases, dst, side="right").astype(np.int64) - 1, 0, None)
        base, item, count = self._bases[at], self._items[at], self._counts[at]
        inside = (dst >= base) & (size > 0)
        first = np.where(inside, (dst - np.minimum(dst, base)) // item, 0)
        last = np.where(inside, np.minimum((dst - np.minimum(dst, base) + np.minimum(size, item * count)
                                            + item - np.uint64(1)) // item, count), 0)
        keep = inside & (last > first)
        tag = tags[keep] << np.uint64(_TAG)
        lo, hi = merge_ranges(tag | (self._keys[at[keep]] + first[keep]), tag | (self._keys[at[keep]] + last[keep]))
        request = (lo >> np.uint64(_TAG)).astype(np.int64)
        place = lo & np.uint64((1 << _TAG) - 1)
        entry = np.searchsorted(self._keys, place, side="right").astype(np.int64) - 1
        np.add.at(touched, (request, self._order[entry]), (hi - lo).astype(np.int64))
        return touched

    def _written(self, note: Any, touched: np.ndarray) -> bool:
        """Whether a component's or the aux row's note has rows behind it (``touched``: one request's row
        of :meth:`_touched`). A note of no component this side holds is the tracker's to refuse."""
        at = len(self.side.kv.entries)
        for component in self.side.state:
            n = len(component.entries)
            if component.name == note.name and note.role != AUX_ROLE:
                mine = touched[at : at + n]
                if note.layers is not None and component.layers:
                    ids = np.asarray(component.layers, np.int64)
                    mine = mine[(ids >= note.layers[0]) & (ids < note.layers[1])]
                return bool(mine.sum() > 0)
            at += n
        if note.role == AUX_ROLE:
            return not self.side.aux or bool(touched[at:].sum() > 0)
        return True

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
