"""Prepared mode: NIXL prepared descriptor lists (entry x slot, made once per peer), posted with the
planner's int32 indices, one write per section."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ...errors import LayoutError
from ...planner.model import Transfer
from ...planner.pairing import pair_sides
from ...planner.plan import AUX_ROLE, KV_ROLE
from ...planner.prepared import prepared_slots

if TYPE_CHECKING:
    from ..prefill import PrefillEndpoint
    from .planned import PlannedBatch


def prepare(ep: PrefillEndpoint, dest: int) -> None:
    """NIXL prepared lists for every role towards peer ``dest``."""
    if not ep.engine.capabilities.prepared:
        raise LayoutError(f"the {type(ep.engine).__name__} has no prepared descriptor lists; use direct mode")
    peer = ep.peers[dest]
    pairing = pair_sides(ep.side, peer.side)
    tables = {KV_ROLE: (pairing.kv_src, pairing.kv_dst), AUX_ROLE: (pairing.aux_src, pairing.aux_dst)}
    tables.update({c: t for c, t in enumerate(zip(pairing.state_src, pairing.state_dst))})
    for role, (entries, src_slots, dst_slots) in prepared_slots(ep.side, peer.side).items():
        src_t, dst_t = tables[role]
        items = lambda t, slots: np.concatenate([t, np.full((len(t), 1), slots, np.uint64)], axis=1)  # noqa: E731
        ep.engine.prepare(peer.name, role, items(src_t, src_slots), items(dst_t, dst_slots))
    peer.prepared = True


def send(ep: PrefillEndpoint, transfers: Sequence[Transfer], planned: PlannedBatch, pending: Any, batch: Any,
         deadline: float) -> dict[Any, str | None]:
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
    return ep._settle(transfers, posted, deadline)
