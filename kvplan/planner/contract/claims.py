"""Destination claims (planning.md §6.1): no two writes of one batch land on one destination item.

Every element a batch sends claims one item on its destination: a KV page, a state component's
page, slot or row, an aux row. Two transfers that claim the same item (two requests given one
decode page by a broken allocator, or one request listing a page twice) would overwrite each
other's bytes, and nothing downstream could tell. A batch with such a pair is refused whole, with
a :class:`~kvplan.errors.DestinationOverlapError` naming both requests.

This module is the host statement of the rule. The reference applies it to its plan; the device
planner flags overlaps with a claim bitmap inside its kernels and, only when the flag is up, calls
:func:`check_claims` here for the exact error.

Example::

    claims = [Claims("a", 0, np.array([3, 4]), (), None), Claims("b", 0, np.array([4]), (), None)]
    check_claims(claims)     # DestinationOverlapError: request 'b': destination 0 KV page 4 ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ...errors import DestinationOverlapError

__all__ = ["Claims", "check_claims", "overlaps"]

_ID_BITS = 40


@dataclass(frozen=True)
class Claims:
    """What one transfer writes on its destination: KV pages, each state component's items, an aux row."""

    request: Any
    dest: int
    kv: np.ndarray
    state: tuple[np.ndarray, ...]
    aux: int | None

    @classmethod
    def of_lists(cls, t: Any, lists: Any) -> "Claims":
        """The claims of transfer ``t`` from its checked lists (a ``TransferLists``)."""
        return cls(t.request, t.dest, lists.dst_pages if lists.sent else lists.dst_pages[:0],
                   tuple(d for _, d in lists.state), t.aux_dst if lists.aux else None)

    @classmethod
    def of_plan(cls, t: Any, planned: Any) -> "Claims":
        """The claims of transfer ``t`` from its :class:`~kvplan.planner.contract.plan.TransferPlan`."""
        return cls(t.request, t.dest, planned.dst_pages if planned.sent else planned.dst_pages[:0],
                   tuple(c.dst_list for c in planned.state), t.aux_dst if len(planned.aux_descs) else None)


def _what(k: int, names: Sequence[str]) -> str:
    if k == 0:
        return "KV page"
    if k == len(names) + 1:
        return "aux row"
    return f"{names[k - 1]} item"


def overlaps(claims: Sequence[Claims], names: Sequence[str] = ()) -> list[DestinationOverlapError]:
    """Every destination item claimed again after its first claim, in batch order, as errors.

    ``names`` are the state components' names (for the messages). One error per pair of requests
    (the first item they share); the error's ``request`` is the later claimant.
    """
    K = 2 + max((len(c.state) for c in claims), default=0)
    keys, owner, pos = [], [], []
    for i, c in enumerate(claims):
        lists = [np.asarray(c.kv, np.int64), *(np.asarray(s, np.int64) for s in c.state),
                 np.asarray([] if c.aux is None else [c.aux], np.int64)]
        for k, ids in enumerate(lists):
            if not ids.size:
                continue
            k = K - 1 if k == len(lists) - 1 else k
            keys.append(((c.dest * K + k) << _ID_BITS) + ids)
            owner.append(np.full(ids.size, i, np.int64))
            pos.append(np.arange(ids.size, dtype=np.int64))
    if not keys:
        return []
    key, who, at = np.concatenate(keys), np.concatenate(owner), np.concatenate(pos)
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    again = np.flatnonzero(first[inverse] != np.arange(key.size))
    found: list[DestinationOverlapError] = []
    seen: set[tuple[int, int]] = set()
    names = list(names) or [f"state component {c}" for c in range(K - 2)]
    for e in again.tolist():
        f = int(first[inverse[e]])
        pair = (int(who[f]), int(who[e]))
        if pair in seen:
            continue
        seen.add(pair)
        later, earlier = claims[pair[1]], claims[pair[0]]
        group = int(key[e] >> _ID_BITS)
        item = int(key[e] & ((1 << _ID_BITS) - 1))
        what = f"destination {later.dest} {_what(group % K, names)} {item}"
        if pair[0] == pair[1]:
            reason = (f"{what} is written twice by this request (positions {int(at[f])} and {int(at[e])} of its "
                      "list): a destination item may be written once per batch")
        else:
            reason = (f"{what} (position {int(at[e])}) is also written by request {earlier.request!r} (position "
                      f"{int(at[f])}): two requests of one batch may not share a destination item")
        found.append(DestinationOverlapError(later.request, earlier.request, reason))
    return found


def check_claims(claims: Sequence[Claims], names: Sequence[str] = ()) -> None:
    """Raise the first :class:`~kvplan.errors.DestinationOverlapError` of :func:`overlaps`, if any."""
    found = overlaps(claims, names)
    if found:
        raise found[0]
