"""Prepared mode: NIXL prepared descriptor lists (entry x slot, made once per peer), posted with the
planner's int32 indices, one write per section."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ...errors import LayoutError
from ...planner.contract.batch import SideMemory, Transfer
from ...planner.contract.pairing import pair_sides
from ...planner.contract.plan import AUX_ROLE, KV_ROLE
from ...planner.device.prepared import prepared_slots
from ..runtime.moving import Moving
from .context import SendContext
from .planned import PlannedBatch


def prepared_items(src: SideMemory, dst: SideMemory) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per role, the ``[entries, 4]`` ``(base, item_len, slots, nbytes)`` items of the prepared lists from
    ``src`` to ``dst`` (:meth:`Engine.prepare`): whole items, or for head slices of one span per page
    (``Attention.MHA_HEAD_MAJOR``: KV's and its head-sliced state's) each page's slice, so that the planner's
    indices name the bytes its descriptors would."""
    pairing = pair_sides(src, dst)
    tables = {KV_ROLE: (pairing.kv_src, pairing.kv_dst), AUX_ROLE: (pairing.aux_src, pairing.aux_dst)}
    tables.update({c: t for c, t in enumerate(zip(pairing.state_src, pairing.state_dst))})
    out = {}
    for role, (entries, src_slots, dst_slots) in prepared_slots(src, dst).items():
        src_t, dst_t = tables[role]
        src_items, dst_items = _items(src_t, src_slots), _items(dst_t, dst_slots)
        h = pairing.heads if role == KV_ROLE else None if role == AUX_ROLE else pairing.component_heads(role)
        if h is not None:
            src_items[:, 0] += np.uint64(h.src_head * h.bytes_per_head)
            dst_items[:, 0] += np.uint64(h.dst_head * h.bytes_per_head)
            src_items[:, 3] = dst_items[:, 3] = np.uint64(h.nbytes)
        out[role] = (src_items, dst_items)
    return out


def _items(table: np.ndarray, slots: int) -> np.ndarray:
    """``[entries, 4]`` ``(base, item_len, slots, nbytes)`` of a pairing's ``(base, item_len)`` table: whole items."""
    return np.concatenate([table, np.full((len(table), 1), slots, np.uint64), table[:, 1:2]], axis=1)


def prepare(ep: SendContext, dest: int) -> None:
    """NIXL prepared lists for every role towards peer ``dest``."""
    if not ep.engine.capabilities.prepared:
        raise LayoutError(f"the {type(ep.engine).__name__} has no prepared descriptor lists; use direct mode")
    peer = ep.peers[dest]
    for role, (src_items, dst_items) in prepared_items(ep.side, peer.side).items():
        ep.engine.prepare(peer.name, role, src_items, dst_items)
    peer.prepared = True


def send(ep: SendContext, transfers: Sequence[Transfer], planned: PlannedBatch, pending: Any, batch: Any,
         deadline: float) -> Moving:
    """Post each section's indices into the peer's prepared lists (made on first use), then wait for all."""
    indices = pending.prepared_indices()
    counted = {(s.transfer, s.role): s for s in planned.host_sections()}
    posted = []
    for s, (role, owner) in enumerate(zip(indices.section_role.tolist(), indices.section_transfer.tolist())):
        lo, hi = int(indices.section_offsets[s]), int(indices.section_offsets[s + 1])
        section = counted.get((owner, role))
        if lo == hi or section is None:
            continue
        dest = transfers[owner].dest
        peer = ep.peers[dest]
        if not peer.prepared:
            prepare(ep, dest)
        posted.append((ep.engine.post_prepared(peer.name, role, indices.src[lo:hi], indices.dst[lo:hi],
                                               peer.notification(section)), section))
    return ep.verbs.settle(transfers, posted, deadline)
