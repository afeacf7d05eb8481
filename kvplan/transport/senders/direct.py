"""Direct mode: every section of a planned batch (a transfer's KV, each state component, aux) posted
as one engine write with its notification, all of them before waiting for any."""

from __future__ import annotations

import logging
from typing import Any, Sequence

from ...planner.contract.batch import Transfer
from ..runtime.moving import Moving
from .context import SendContext
from .planned import PlannedBatch

log = logging.getLogger(__name__)


def send(ep: SendContext, transfers: Sequence[Transfer], planned: PlannedBatch, pending: Any, batch: Any,
         deadline: float) -> Moving:
    """Post every section, then wait for all of them (the endpoint's completion path)."""
    if ep.engine.capabilities.device:
        return _send_device(ep, transfers, planned, pending, batch, deadline)
    descs, posted = planned.host_descs(), []
    for s in planned.host_sections():
        dest = transfers[s.transfer].dest
        peer = ep.peers[dest]
        posted.append((ep.engine.post(peer.name, descs[s.lo : s.hi], peer.notification(s)), s))
        log.debug("posted %s of %r: %d descriptors to peer %d", s.name, s.request, s.hi - s.lo, dest)
    return ep.verbs.settle(transfers, posted, deadline)


def _send_device(ep: SendContext, transfers: Sequence[Transfer], planned: PlannedBatch, pending: Any, batch: Any,
                 deadline: float) -> Moving:
    """An engine that writes from the plan's device descriptors (``Capabilities.device``): one post per
    decode endpoint, over that endpoint's rows of the plan as they lie on the device, each section's
    notification sent once the whole launch has ended."""
    import torch

    count = max(1, int(planned.per_transfer[-1]))
    typical = max(1, planned.nbytes // count)
    if planned.launched is not None:  # launched behind the plan: its sections, in the plan's rows, attach
        launched, sections = planned.launched, planned.host_sections()
        peer = ep.peers[launched.dest]
        handles = ep.engine.section_handles(launched.launch, [peer.notification(s) for s in sections],
                                            [(s.lo, s.hi) for s in sections])
        log.debug("%d sections to peer %d: launched behind their plan", len(sections), launched.dest)
        return ep.verbs.settle(transfers, list(zip(handles, sections)), deadline)
    table = pending.device_descriptors()
    by_peer: dict[int, list[Any]] = {}
    for s in planned.host_sections():
        by_peer.setdefault(transfers[s.transfer].dest, []).append(s)
    alignment = ep.verbs.alignment(batch)
    posted = []
    for dest, sections in by_peer.items():
        peer = ep.peers[dest]
        spans = sorted({(s.lo, s.hi) for s in sections})
        if all(a[1] == b[0] for a, b in zip(spans, spans[1:])):  # one block of the plan: no copy
            rows, first = table[spans[0][0] : spans[-1][1]], spans[0][0]
            bounds = [(s.lo - first, s.hi - first) for s in sections]
        else:  # (several decode endpoints' transfers interleaved: this one's rows gathered on the device)
            at, starts = 0, {}
            for lo, hi in spans:
                starts[(lo, hi)], at = at, at + hi - lo
            rows = torch.cat([table[lo:hi] for lo, hi in spans])
            bounds = [(starts[(s.lo, s.hi)], starts[(s.lo, s.hi)] + s.hi - s.lo) for s in sections]
        handles = ep.engine.post_device(peer.name, rows, [peer.notification(s) for s in sections], bounds,
                                        alignment=alignment, typical_bytes=typical)
        posted += list(zip(handles, sections))
        log.debug("posted %d sections to peer %d: %d descriptors in one launch", len(sections), dest, len(rows))
    return ep.verbs.settle(transfers, posted, deadline)
