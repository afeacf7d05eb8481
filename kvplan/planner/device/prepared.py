"""Index arrays for NIXL prepared descriptor lists (``make_prepped_xfer``).

A prepared list registers, once per peer, one descriptor per entry x slot of a pool: descriptor
``entry * num_slots + slot``. A transfer then names descriptors by int32 index instead of
building addresses. kvplan produces, per section of each transfer (KV, each state component,
aux, in plan order), the source and destination index arrays, entry-major: for entry ``e``, every
element ``k`` of the section's list. NIXL merges neighbouring descriptors itself, so these are
per page, not per run. Direct mode, and head slices of one span per page (``Attention.MHA_HEAD_MAJOR``:
the lists then hold each page's slice, the indices are the same).

The int32 range is checked once per layout: ``entries * num_slots`` must stay below ``2**31``.

Example::

    indices = prepared_indices_reference(batch, plan_reference(batch))
    for s in range(len(indices.section_role)):
        lo, hi = indices.section_offsets[s], indices.section_offsets[s + 1]
        agent.make_prepped_xfer("WRITE", local[role], indices.src[lo:hi], remote[role], indices.dst[lo:hi], ...)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...errors import LayoutError
from ..contract.batch import Batch, SideMemory
from ..contract.pairing import pair_sides
from ..contract.plan import Plan, Role

__all__ = ["AUX", "KV", "PreparedIndices", "prepared_indices_reference", "prepared_slots", "require_prepared_form"]

KV, AUX = Role.KV, Role.AUX  # section roles besides component indices
INT32_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class PreparedIndices:
    """int32 index arrays of every section, with ``section_offsets`` ``[sections + 1]``.

    ``section_role[s]`` is ``KV``, ``AUX`` or a component index; ``section_transfer[s]`` the
    transfer it belongs to.
    """

    src: np.ndarray
    dst: np.ndarray
    section_offsets: np.ndarray
    section_role: np.ndarray
    section_transfer: np.ndarray

    def assert_equal(self, other: "PreparedIndices") -> None:
        for name in ("src", "dst", "section_offsets", "section_role", "section_transfer"):
            x, y = getattr(self, name), getattr(other, name)
            assert x.dtype == y.dtype and np.array_equal(x, y), f"prepared indices differ in {name}"


def prepared_slots(src: SideMemory, dst: SideMemory) -> dict[int, tuple[int, int, int]]:
    """Per role: ``(entries, src_slots, dst_slots)``; raises if an index could overflow int32."""
    roles = {KV: (len(src.kv.entries), src.kv.num_pages, dst.kv.num_pages)}
    if src.aux:
        roles[AUX] = (len(src.aux), min(e.num_items for e in src.aux), min(e.num_items for e in dst.aux))
    for c, (sc, dc) in enumerate(zip(src.state, dst.state)):
        roles[c] = (len(sc.entries), sc.num_items, dc.num_items)
    for role, (entries, s_slots, d_slots) in roles.items():
        name = {KV: "KV", AUX: "aux"}.get(role) or src.state[role].name
        if entries * max(s_slots, d_slots) > INT32_MAX:
            raise LayoutError(f"a prepared list of {name} would hold {entries} x {max(s_slots, d_slots)} descriptors: "
                              "its indices overflow int32")
    return roles


def require_prepared_form(src: SideMemory, dsts: Sequence[SideMemory]) -> None:
    """Raise :class:`LayoutError` unless every pairing from ``src`` moves one descriptor per entry x item
    (``SidePairing.per_item``), the form prepared lists index."""
    if not all(pair_sides(src, d).per_item for d in dsts):
        raise LayoutError("prepared lists are per page: head slices of each token and TP-sliced state need "
                          "descriptors")


def prepared_indices_reference(batch: Batch, plan: Plan) -> PreparedIndices:
    """The index arrays of a reference plan (direct mode, or head slices of one span per page)."""
    slots = [prepared_slots(batch.src, d) for d in batch.dsts]
    require_prepared_form(batch.src, batch.dsts)
    src_parts, dst_parts, sizes, roles, owners = [], [], [], [], []

    def section(t: int, role: int, src_list: np.ndarray, dst_list: np.ndarray) -> None:
        entries, s_slots, d_slots = slots[plan.transfers[t].dest][role]
        e = np.arange(entries, dtype=np.int64)[:, None]
        src_parts.append((e * s_slots + src_list[None, :]).reshape(-1).astype(np.int32))
        dst_parts.append((e * d_slots + dst_list[None, :]).reshape(-1).astype(np.int32))
        sizes.append(entries * len(src_list))
        roles.append(role)
        owners.append(t)

    for i, (t, tp) in enumerate(zip(batch.transfers, plan.transfers)):
        if tp.sent:
            section(i, KV, tp.src_pages, tp.dst_pages)
        for c, comp in enumerate(tp.state):
            section(i, c, comp.src_list, comp.dst_list)
        if tp.last and batch.src.aux:
            section(i, AUX, np.array([t.aux_src], np.int64), np.array([t.aux_dst], np.int64))
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    join = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int32)  # noqa: E731
    return PreparedIndices(join(src_parts), join(dst_parts), offsets, np.array(roles, np.int64),
                           np.array(owners, np.int64))
