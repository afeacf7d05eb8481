"""Direct mode: every section of a planned batch (a transfer's KV, each state component, aux) posted
as one engine write with its notification, all of them before waiting for any."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

from ...planner.model import Transfer

if TYPE_CHECKING:
    from ..prefill import PrefillEndpoint
    from .planned import PlannedBatch

log = logging.getLogger("kvplan")


def send(ep: PrefillEndpoint, transfers: Sequence[Transfer], planned: PlannedBatch, pending: Any, batch: Any,
         deadline: float) -> dict[Any, str | None]:
    """Post every section, then wait for all of them (the endpoint's completion path)."""
    descs, posted = planned.host_descs(), []
    for s in planned.host_sections():
        dest = transfers[s.transfer].dest
        peer = ep.peers[dest]
        posted.append((ep.engine.post(peer.name, descs[s.lo : s.hi], peer.notification(s)), s))
        log.debug("posted %s of %r: %d descriptors to peer %d", s.name, s.request, s.hi - s.lo, dest)
    return ep._settle(transfers, posted, deadline)
