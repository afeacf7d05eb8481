"""Streamed sends: a batch that the forward pass is still writing, each layer group moved once the
pass has marked it written (docs/layerwise.md): as direct writes, waited for together at the end, or
as one staged run per group and peer, announced while the pass still writes the group."""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import numpy as np
import torch

from ... import env
from ...planner.contract.layer_groups import group_sections
from ...planner.contract.batch import Transfer
from ...planner.contract.pairing import pair_sides
from ...planner.contract.plan import Section
from ..engines import Handle
from ..pause import Pause
from ..runtime.moving import drive
from ..readiness import LayerStreaming
from .planned import PlannedBatch
from .staged import StagedRun, staged_run
from .context import SendContext

__all__ = ["GroupedSend", "send"]

log = logging.getLogger(__name__)


def send(ep: SendContext, transfers: Sequence[Transfer], descs: np.ndarray, sections: Sequence[Section],
         layers: LayerStreaming, deadline: float, staged: tuple[torch.Tensor, int] | None,
         launched: tuple[torch.Tensor, int] | None = None) -> dict[Any, str | None]:
    """Move each layer group's sections once the forward pass has written the group: posted as
    direct writes (waited for together at the end), or, with ``staged`` (the batch's device
    descriptors and alignment), as one staged run per group and peer. With ``launched`` (the same,
    for an engine that writes from device descriptors), each group's direct writes are one launch per
    peer queued behind the group's mark event where the pass recorded one: on the device, with no
    host step between the mark and the bytes."""
    pairings = [pair_sides(ep.side, p.side) for p in ep.peers]
    per_group = group_sections(sections, pairings, ep.side, [t.dest for t in transfers], layers.groups)
    ep.last_mode, ep.last_announcement = ("staged", "table") if staged else ("direct", None)
    grouped = GroupedSend(ep, transfers, descs, per_group, layers, deadline, staged, launched)
    grouped.run()
    result = dict(drive(ep.verbs.settle(transfers, grouped.posted, deadline)))
    if grouped.trace is not None:
        grouped.trace.append((len(per_group), "settled", time.perf_counter()))
        log.warning("layer groups (group, step, clock ms): %s",
                    [(g, k, round(t * 1e3, 3)) for g, k, t in grouped.trace])
    for request, reason in grouped.failed.items():
        result[request] = result.get(request) or reason
    return result


def group_run(transfers: Sequence[Transfer], dest: int, parts: Sequence[Any], descs: np.ndarray,
              device_descs: torch.Tensor, alignment: int) -> PlannedBatch:
    """One layer group's share for peer ``dest`` as a staged batch: its parts' descriptors back to
    back (transfer by transfer), each part one section over them, announced with tables."""
    mine = [k for k, t in enumerate(transfers) if t.dest == dest]
    local = {k: i for i, k in enumerate(mine)}
    rows = np.concatenate([p.rows() for p in parts])
    counts = np.zeros(len(mine), np.int64)
    group_sections_, at = [], 0
    for p in parts:
        group_sections_.append(Section(local[p.transfer], p.request, p.role, p.name, at, at + p.num_descs, p.count,
                                       p.layers))
        counts[local[p.transfer]] += p.num_descs
        at += p.num_descs
    per_transfer = np.concatenate([[0], np.cumsum(counts)])
    index = torch.from_numpy(rows).to(device_descs.device, non_blocking=True)
    return PlannedBatch([transfers[k] for k in mine], descs[rows], per_transfer, group_sections_,
                        device_descs.index_select(0, index), plannable=False)


def until_ready(ep: SendContext, readiness, group: int, posted: list[tuple[Handle, Any]], dests: Sequence[int],
                deadline: float, queued: bool = False) -> str | None:
    """Wait (progressing what is posted; :mod:`..pause` between looks) until layer group ``group`` is
    written, or with ``queued`` until its mark is at least queued with an event to wait on
    (``readiness.written``); the reason it never was, else ``None``."""
    pause = Pause(longest_s=1e-4)  # a group is written within milliseconds: short slices once quiet
    written = getattr(readiness, "written", None) if queued else None
    while readiness.ready() <= group and (written is None or written(group) is None):
        if time.monotonic() > deadline:
            return f"layer group {group} was not written before the deadline"
        if (gone := ep.verbs.any_peer_gone(dests)) is not None:
            return gone
        for handle, _ in posted:
            if handle.state == "PROC" and ep.engine.progress(handle) != "PROC":
                pause.busy()
        pause()
    return None


class GroupedSend:
    """One streamed send (:meth:`~kvplan.transport.prefill.PrefillEndpoint.send` with ``layers``): each layer group once the
    forward pass has marked it. A group's staged runs are announced while the forward pass still
    writes it (destination tables, byte offsets on the device): once it is marked, its bytes need
    only gathering and writing."""

    def __init__(self, ep: SendContext, transfers: Sequence[Transfer], descs: np.ndarray, per_group: list,
                 layers: LayerStreaming, deadline: float, staged: tuple[torch.Tensor, int] | None,
                 launched: tuple[torch.Tensor, int] | None = None):
        self.ep, self.transfers, self.descs, self.per_group = ep, transfers, descs, per_group
        self.layers, self.deadline, self.staged, self.launched = layers, deadline, staged, launched
        self.dests = sorted({t.dest for t in transfers})
        self.posted: list[tuple[Handle, Any]] = []  # direct writes, waited for together at the end
        self.failed: dict[Any, str | None] = {}
        self.announced: dict[int, list[StagedRun]] = {}
        self.runs: list[StagedRun] = []  # every group's, in order: their traces are logged at the end, not
        # while the next group's mark may come (logging takes long)
        self.trace: list | None = [] if env.enabled("KVPLAN_TRACE") else None

    def merge(self, result: dict[Any, str | None]) -> None:
        for request, reason in result.items():
            self.failed[request] = self.failed.get(request) or reason

    def announce(self, g: int) -> None:
        """Announce group ``g``'s staged runs (one per peer) ahead of its mark."""
        if self.staged is None or g >= len(self.per_group) or g in self.announced:
            return
        ep, runs = self.ep, []
        for dest in self.dests:
            mine = [s for s in self.per_group[g] if self.transfers[s.transfer].dest == dest]
            if mine:
                share = group_run(self.transfers, dest, mine, self.descs, *self.staged)
                run = staged_run(ep, dest, share, self.staged[1], self.deadline)
                self.runs.append(run)
                if run.announce():
                    runs.append(run)
                else:
                    self.merge(run.result)
        self.announced[g] = runs

    def queue_ahead(self, g: int) -> None:
        """Queue the gathers of group ``g``'s first waves behind its mark, into the slots that are
        free: only once the group before it has moved, whose waves used them."""
        written = getattr(self.layers.readiness, "written", None)
        runs = self.announced.get(g)
        if runs and written is not None:  # the runs share the staging slots: only the first goes ahead
            runs[0].gather_ahead(written(g))

    def run(self) -> None:
        try:
            self._run()
        finally:
            for run in self.runs:
                run.log_trace()

    def _run(self) -> None:
        ep = self.ep
        self.announce(0)
        self.queue_ahead(0)
        for g, parts in enumerate(self.per_group):
            why = until_ready(ep, self.layers.readiness, g, self.posted, self.dests, self.deadline,
                              queued=self.launched is not None)
            self._mark(g, "ready")
            if why is not None:  # nothing of this group or later ones goes out
                for s in (s for later in self.per_group[g:] for s in later):
                    ep.verbs.fail(self.transfers[s.transfer].dest, self.failed, [s.request], why)
                return
            if self.staged is not None:
                # the next group's tables go out first: the receiver checks them while this group moves
                self.announce(g + 1)
                for run in self.announced.pop(g):
                    self.merge(run.move())
                self.queue_ahead(g + 1)
            elif self.launched is not None:
                self._launch(g, parts)
            else:
                for s in parts:
                    rows = self.descs[s.spans[0][0]:s.spans[0][1]] if len(s.spans) == 1 else self.descs[s.rows()]
                    peer = ep.peers[self.transfers[s.transfer].dest]
                    self.posted.append((ep.engine.post(peer.name, rows, peer.notification(s)), s))
            self._mark(g, "sent")

    def _launch(self, g: int, parts: Sequence[Any]) -> None:
        """Group ``g``'s sections as one launch per peer, over their rows gathered on the device, queued
        behind the group's mark event (where the pass recorded one; else the mark was read here)."""
        ep, (device_descs, alignment) = self.ep, self.launched
        written = getattr(self.layers.readiness, "written", None)
        after = written(g) if written is not None else None
        for dest in self.dests:
            mine = [s for s in parts if self.transfers[s.transfer].dest == dest]
            if not mine:
                continue
            rows = [s.rows() for s in mine]
            bounds = np.cumsum([0] + [len(r) for r in rows])
            index = torch.from_numpy(np.concatenate(rows)).to(device_descs.device, non_blocking=True)
            share = device_descs.index_select(0, index)
            nbytes = int(sum(int(self.descs[r, 2].sum(dtype=np.uint64)) for r in rows))
            peer = ep.peers[dest]
            launch = ep.engine.launch_device(peer.name, share, after=after, alignment=alignment,
                                             typical_bytes=max(1, nbytes // max(1, len(share))))
            handles = ep.engine.section_handles(launch, [peer.notification(s) for s in mine],
                                                list(zip(bounds[:-1].tolist(), bounds[1:].tolist())))
            self.posted += list(zip(handles, mine))

    def _mark(self, group: int, step: str) -> None:
        if self.trace is not None:
            self.trace.append((group, step, time.perf_counter()))
