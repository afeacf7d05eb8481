"""Staged mode: a batch through a ring of staging slots (:class:`StagedRun`).

Waves of descriptors are gathered into the slots; the gather of one wave, the engine write of
another and the receiver's scatter of a third overlap: the sender needs a slot's credit (returned by
the receiver after its scatter) and the end of its own last write from that slot, nothing else. The
run is announced on the control channel ahead of its bytes: by its chunks alone where the receiver
can plan its own scatter (:mod:`..receiver_plan`), else with every wave's destination table; the
engine's notification, carrying the wave id, says a wave has landed. The first wave's gather may be
queued right behind the plan (:mod:`..ahead`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Sequence

import numpy as np
import torch

from ... import env
from ...errors import LayoutError
from ...planner.device import eager
from ...planner.contract.batch import Batch, Transfer
from ..control import ControlTimeout
from ..engines import Handle, is_unsafe, wait_all
from ..local import gather
from ..pause import Pause
from ..runtime.loop import engine_fds
from ..receiver_plan import planned_run_message, planned_run_waves
from ..waves import Wave, decode_credit, one_wave, plan_waves, run_message, wave_note
from .planned import PlannedBatch, split_descriptors
from .context import SendContext
from ..control_messages import Kind

__all__ = ["StagedBatch", "StagedRun", "route_notes", "send", "share_of", "staged_run"]

log = logging.getLogger(__name__)

PART_ALIGN = 4096  # a staging part's bytes are a multiple of this (every copy word divides it)


def send(ep: SendContext, transfers: Sequence[Transfer], planned: PlannedBatch, pending: Any, batch: Any,
         deadline: float) -> StagedBatch:
    """Each peer's share of the batch through its own staging ring, as a :class:`StagedBatch`: every peer's at
    once, each share read from the one plan. With several peers each run uses its peer's part of this
    side's staging buffer (split evenly by peer), so that runs of other batches to other peers move
    alongside."""
    dests = sorted({t.dest for t in transfers})
    alignment = ep.verbs.alignment(batch)
    if len(ep.peers) == 1:
        runs = [staged_run(ep, dests[0], replace(planned, device_descs=pending.device_descriptors()), alignment,
                           deadline)]
    else:
        runs = [staged_run(ep, dest, share_of(ep, planned, pending, batch, dest), alignment, deadline,
                           part=(dest, len(ep.peers))) for dest in dests]
    return StagedBatch(ep, runs)


class StagedBatch:
    """A batch's staged runs, one per peer, as a :class:`~..runtime.moving.Moving`: a run is announced once
    its part of the staging buffer and its peer are free of other batches' runs (:attr:`SendContext.runs`),
    then stepped with the others; the engine's notifications are read once a turn and handed to the run
    whose peer sealed them, whichever batch it belongs to (:func:`route_notes`)."""

    def __init__(self, ep: SendContext, runs: Sequence[StagedRun]):
        self.ep, self.runs = ep, list(runs)
        self.waiting = list(runs)  # not announced yet
        self.moving: list[StagedRun] = []
        self._result: dict[Any, str | None] = {}

    def step(self) -> bool:
        moved = self._start()
        moved = route_notes(self.ep) or moved
        for run in self.moving:
            moved = run.step() or moved
        for run in [run for run in self.moving if run.done() or run.stopped()]:
            self.moving.remove(run)
            self._end(run, run.finish())
            moved = True
        return moved

    def done(self) -> bool:
        return not self.waiting and not self.moving

    def result(self) -> dict[Any, str | None]:
        return self._result

    def channels(self) -> Sequence[Any]:
        return [run.peer.channel for run in self.moving]

    def _start(self) -> bool:
        """Announce the runs whose staging part and peer are free; fail those whose deadline passed first."""
        started = False
        for run in list(self.waiting):
            if time.monotonic() > run.deadline:
                self.waiting.remove(run)
                self.ep.verbs.fail(run.dest, run.result, list(run.result),
                                   "deadline passed while its staged run waited for the staging ring")
                self._merge(run.result)
                continue
            if any(other.dest == run.dest or other.overlaps(run) for other in self.ep.runs):
                continue
            self.waiting.remove(run)
            started = True
            run.own_notes = False
            self.ep.runs.append(run)
            if run.announce():
                self.moving.append(run)
            else:
                self._end(run, run.result)
        return started

    def _end(self, run: StagedRun, result: dict[Any, str | None]) -> None:
        if run in self.ep.runs:
            self.ep.runs.remove(run)
        run.log_trace()
        self._merge(result)

    def _merge(self, result: dict[Any, str | None]) -> None:
        for request, reason in result.items():
            self._result[request] = self._result.get(request) or reason


def route_notes(ep: SendContext) -> bool:
    """Read the engine's notifications once, where a moving run takes its credits from them, and hand each to
    the run whose decode sealed it; whether any came."""
    runs = [run for run in ep.runs if not run.own_notes]
    if not any(run.wants_notes() for run in runs):
        return False
    notes = ep.engine.notifications()
    came = bool(notes)
    for run in runs:
        notes = run.take_notes(notes)
    for _, raw in notes:
        log.warning("refused an engine notification that is not sealed by a decode of a moving run: %r", raw[:80])
    return came


def share_of(ep: SendContext, planned: PlannedBatch, pending: Any, batch: Batch, dest: int) -> PlannedBatch:
    """Peer ``dest``'s share of a planned batch, read from the plan: its transfers' rows of the descriptors
    (host and device) and their sections, renumbered (a plan's rows are each transfer's, in order)."""
    descs, rows, sections = planned.host_descs(), planned.per_transfer, planned.host_sections()
    picked = [k for k, t in enumerate(planned.transfers) if t.dest == dest]
    counts = np.array([rows[k + 1] - rows[k] for k in picked], np.int64)
    per_transfer = np.zeros(len(picked) + 1, np.int64)
    np.cumsum(counts, out=per_transfer[1:])
    index = np.concatenate([np.arange(rows[k], rows[k + 1], dtype=np.int64) for k in picked]) if picked \
        else np.zeros(0, np.int64)
    renumbered = {k: j for j, k in enumerate(picked)}
    share_sections = []
    for s in sections:
        j = renumbered.get(s.transfer)
        if j is None:
            continue
        if not rows[s.transfer] <= s.lo <= s.hi <= rows[s.transfer + 1]:  # (not a plan's layout: planned again)
            return _planned_again(ep, planned, batch, dest)
        shift = int(per_transfer[j]) - int(rows[s.transfer])
        share_sections.append(replace(s, transfer=j, lo=s.lo + shift, hi=s.hi + shift))
    device = pending.device_descriptors()
    on_device = device.index_select(0, torch.from_numpy(index).to(device.device, non_blocking=True))
    share = tuple(replace(planned.transfers[k], dest=0) for k in picked)
    return PlannedBatch(share, descs[index], per_transfer, share_sections, on_device)


def _planned_again(ep: SendContext, planned: PlannedBatch, batch: Batch, dest: int) -> PlannedBatch:
    share = tuple(replace(t, dest=0) for t in planned.transfers if t.dest == dest)
    sub = eager.plan(Batch(ep.side, (ep.peers[dest].side,), share, ep.policy))
    return PlannedBatch(share, *sub.descriptors(), sub.sections(), sub.device_descriptors())


def staged_run(ep: SendContext, dest: int, batch: PlannedBatch, alignment: int, deadline: float,
               part: tuple[int, int] = (0, 1)) -> StagedRun:
    """A run of ``batch`` to peer ``dest`` (not announced yet), in part ``part[0]`` of ``part[1]`` equal parts
    of this side's staging buffer."""
    if ep.staging is None or ep.peers[dest].staging is None:
        raise LayoutError("staged mode needs a registered staging buffer on both sides")
    return StagedRun(ep, dest, batch, alignment, deadline, part)


class StagedRun:
    """One batch through the staging ring (see :class:`PrefillEndpoint`)."""

    def __init__(self, ep: SendContext, dest: int, batch: PlannedBatch, alignment: int, deadline: float,
                 part: tuple[int, int] = (0, 1)):
        self.ep, self.dest, self.peer = ep, dest, ep.peers[dest]
        self.alignment, self.deadline = alignment, deadline
        self.result: dict[Any, str | None] = {t.request: None for t in batch.transfers}
        # this run's part of the staging buffer here (the batch's other peers' runs use the others at once)
        part_bytes = ep.staging.numel() // part[1] // PART_ALIGN * PART_ALIGN if part[1] > 1 else ep.staging.numel()
        self.local_base = part[0] * part_bytes
        self.slots, self.slot_bytes = ep.verbs.ring(dest, alignment, part_bytes)
        self.announced = False
        self._slot_wait = False  # (the wave waiting for a free slot was counted)
        self.own_notes = True  # reads the engine's notifications itself (False: route_notes hands them over)
        self.transfers, self.plannable, self.chunks_run = batch.transfers, batch.plannable, batch.chunks_run
        self.batch, self.nbytes = batch, batch.nbytes
        if batch.descs is None and batch.nbytes <= self.slot_bytes:  # one wave, no descriptor to split:
            self.descs, first = None, None  # its sizes are not needed (announce)
        else:
            self.descs, first = split_descriptors(batch.host_descs(), self.slot_bytes)
        self.count = int(batch.per_transfer[-1]) if first is None else len(self.descs)
        device_descs = batch.device_descs
        if first is not None:  # a descriptor larger than a slot goes in pieces
            device_descs = torch.from_numpy(self.descs.view(np.int64)).to(device_descs.device)
            self.sections = [replace(s, lo=int(first[s.lo]), hi=int(first[s.hi])) for s in batch.host_sections()]
            self.rows = first[batch.per_transfer]  # each transfer's rows
        else:  # (a run the receiver plans needs no sections: it counts its own)
            self.sections = batch.host_sections() if self.descs is not None else batch.sections
            self.rows = batch.per_transfer
        self.device_descs = device_descs
        # the first wave, gathered behind the plan (.ahead): usable unless the descriptors were re-split
        self.ahead = batch.ahead if first is None and batch.ahead is not None and \
            batch.ahead.serves(device_descs, self.slot_bytes) else None
        self._owners: np.ndarray | None = None
        self.host_starts: np.ndarray | None = None  # each descriptor's byte offset, where descs are on the host
        if self.descs is not None:
            self.host_starts = np.zeros(len(self.descs) + 1, np.int64)
            np.cumsum(self.descs[:, 2].view(np.int64), out=self.host_starts[1:])
        if ep.ahead is not None and self.count:  # what the next run's gather ahead expects
            ep.ahead.typical = max(1, self.nbytes // self.count)
        self.dev_starts: torch.Tensor | None = None  # made after the announcement has left
        self.remote_free = [True] * self.slots
        self.local_write: list[Handle | None] = [None] * self.slots
        self.gathered: list[tuple[Wave, Any]] = []  # waves gathered, not yet posted, in order
        self.writes: dict[int, tuple[np.ndarray, bytes]] = {}  # a gathered wave's region and note, made ahead
        self.next_wave = 0  # waves [0, next_wave) are gathered (or queued to be)
        self.posted: dict[int, tuple[Wave, Handle]] = {}
        self.acked: set[int] = set()
        self.gone: str | None = None  # why the receiver is known to be gone
        self.base_id = 0  # the id of its first wave: taken from the endpoint when announced
        self.waves: list[Wave] = []  # planned when announced
        self.deferred: dict[str, Any] | None = None  # a staged-waves header sent once the first wave is posted
        self.trace: list[tuple[int, str, float]] | None = None
        if env.enabled("KVPLAN_TRACE"):
            self.trace = [(0, step, t) for step, t in ep.times]
            self._mark(0, "init")

    @property
    def owners(self) -> np.ndarray:
        """Each descriptor's request (made when first asked: only failures need it)."""
        if self._owners is None:
            requests = np.array([t.request for t in self.transfers] + [None], dtype=object)[:-1]
            self._owners = np.repeat(requests, np.diff(self.rows))
        return self._owners

    def go(self) -> dict[Any, str | None]:
        """Announce the run, then move it (see :meth:`announce` and :meth:`move`)."""
        if not self.announce():
            return self.result
        result = self.move()
        self.log_trace()
        return result

    def announce(self) -> bool:
        """Send the run's announcement (its waves, with destination tables or chunk bounds) and make
        its byte offsets on the device; ``False`` when it could not be sent (its requests have then
        failed). A layer-group run is announced while the forward pass still writes the group, so
        that its bytes only need gathering and writing once the group is ready."""
        ep = self.ep
        if self.descs is None:
            waves = self.waves = one_wave(self.count, self.nbytes, self.sections or [])
        else:
            waves = self.waves = plan_waves(self.descs[:, 2], self.sections, self.slot_bytes, self.slots,
                                            ends=self.host_starts[1:])
        self.base_id = ep.wave_ids(len(waves))
        frames: tuple[bytes, ...] = ()
        # a connection made again before this run (or since its chunks went ahead) loses nothing of it
        replaced = self.peer.channel.replaced()
        if self.chunks_run is not None and not replaced:  # its chunks went ahead: its waves complete it
            kind, header = Kind.STAGED_WAVES, planned_run_waves(ep.id, self.base_id, waves, self.slot_bytes,
                                                             run=self.chunks_run)
            ep.last_announcement = "planned"
        elif ep.receiver_plans and self.peer.plannable and self.plannable and \
                all(t.request in self.peer.planning for t in self.transfers):
            kind, header = Kind.STAGED_PLAN, planned_run_message(ep.id, self.base_id, waves, self.slot_bytes,
                                                              self.alignment, self.transfers)
            ep.last_announcement = "planned"
        else:
            spans = [(t.request, int(self.rows[k]), int(self.rows[k + 1])) for k, t in enumerate(self.transfers)]
            if self.descs is None:  # a light run announced with tables after all (_Batch)
                waves[0].sections = self.batch.host_sections()
            header, table = run_message(ep.id, self.base_id, waves, self.slot_bytes, self.alignment, spans,
                                        self.batch.host_descs() if self.descs is None else self.descs)
            kind, frames = Kind.STAGED, (table,)
            ep.last_announcement = "table"
        if kind == Kind.STAGED_WAVES:
            # the receiver plans from the chunks already: the first wave is posted first, its waves
            # right after (a landing before them waits on the receiver, decode._early)
            self.deferred = header
        else:
            try:  # announced first: the receiver plans or checks the run while this side gathers and writes
                self.peer.channel.send(kind, header, *frames, timeout=max(0.0, self.deadline - time.monotonic()))
            except ControlTimeout as err:
                ep.verbs.fail(self.dest, self.result, list(self.result), str(err))
                return False
            self._mark(0, "tables")
        device_descs = self.device_descs
        if self.ahead is not None:  # the offsets and the first wave's gather are queued already
            self.dev_starts = self.ahead.offsets[: self.count]
            self.remote_free[waves[0].slot] = False
            self.gathered.append((waves[0], self.ahead.event))
            self.next_wave = 1
            ep.first_waves_ahead += 1
            self._mark(0, "ahead")
        elif ep.stream is not None:  # the descriptors were made on the current stream
            ep.stream.wait_stream(torch.cuda.current_stream(ep.staging.device))
            with torch.cuda.stream(ep.stream):  # each descriptor's offset in the whole batch's byte stream
                self.dev_starts = torch.cumsum(device_descs[:, 2], 0).sub_(device_descs[:, 2])
        else:
            self.dev_starts = torch.cumsum(device_descs[:, 2], 0) - device_descs[:, 2]
        return True

    def gather_ahead(self, written: Any) -> int:
        """Queue the gathers of the first waves whose slots are free behind ``written`` (a CUDA event
        the forward pass records once the run's layer group is written): they run the moment the
        group is written, and :meth:`move` posts them once done. How many were queued."""
        if self.ep.stream is None or written is None:
            return 0
        self.ep.stream.wait_event(written)
        start = self.next_wave
        while self.next_wave < len(self.waves) and self._slot_free(self.waves[self.next_wave].slot):
            self._gather(self.waves[self.next_wave])
        self._mark(0, "ahead")
        self.ep.waves_ahead += self.next_wave - start
        return self.next_wave - start

    def move(self) -> dict[Any, str | None]:
        """Gather, write and wait for the credits of every wave of an announced run; the result per request."""
        pause = Pause(fds=engine_fds(self.ep.engine))
        while True:
            if self.step():
                pause.busy()
            if self.done() or self.stopped():
                break
            pause([self.peer.channel])  # a credit on the channel (or the engine's socket) wakes it
        return self.finish()

    def step(self) -> bool:
        """One look: take in credits, post gathered waves, gather the next waves whose slots are free.
        Whether anything moved."""
        moved = self._pump()
        while self.next_wave < len(self.waves) and not self.stopped():
            wave = self.waves[self.next_wave]
            if not self._slot_free(wave.slot):
                if not self._slot_wait:  # every slot of the ring is in flight: this wave waits for a credit
                    self.ep.verbs.stats_hit("staging_slots")
                    self._slot_wait = True
                break
            self._slot_wait = False
            self._mark(wave.index, "gather0")
            self._gather(wave)
            self._pump()
            moved = True
        return moved

    def done(self) -> bool:
        """Whether every wave was gathered, posted and given back by the receiver."""
        return self.next_wave >= len(self.waves) and not self.gathered and all(i in self.acked for i in self.posted)

    def stopped(self) -> bool:
        """Whether the run cannot go on: its deadline passed, or its receiver is gone or was replaced."""
        if time.monotonic() > self.deadline:
            return True
        if self.gone is None and (gone := self.ep.verbs.peer_gone(self.dest)) is not None:
            self.gone = gone
        if self.gone is None and self.peer.channel.replaced():  # what was in flight on the old one is lost
            self.gone = ("the control connection to the decode side was lost and made again during the staged "
                         "run: credits in flight on it may be lost")
        return self.gone is not None

    def finish(self) -> dict[Any, str | None]:
        """The result per request once the run is done or stopped: what is still in flight is aborted,
        every wave not acknowledged fails its requests."""
        ep, waves = self.ep, self.waves
        live = [h for _, h in self.posted.values() if h.state == "PROC"]
        outcome = wait_all(ep.engine, live, time.monotonic()) if live else {}  # aborts what is still in flight
        for index, (wave, handle) in self.posted.items():
            reason = outcome.get(handle) or handle.error
            if is_unsafe(reason):  # (never replaced: a write into the pages may still land)
                reason = f"{reason} ({self.gone})" if self.gone else reason
            elif index not in self.acked:  # a dead receiver is the cause, whatever the engine says
                reason = self.gone or reason or "the receiver did not acknowledge its staged wave before the deadline"
            if reason is not None:
                ep.verbs.fail(self.dest, self.result, wave.requests(self.owners), reason)
        for wave in [w for w, _ in self.gathered] + waves[self.next_wave:]:
            ep.verbs.fail(self.dest, self.result, wave.requests(self.owners), self.gone or "deadline passed before the wave was sent")
        return self.result

    def log_trace(self) -> None:
        """Log what ``KVPLAN_TRACE`` recorded of this run's waves (each step on the clock)."""
        if self.trace is not None:
            log.warning("staged waves (wave, step, clock ms): %s", [(self.base_id + w, k, round(t * 1e3, 3))
                                                                    for w, k, t in self.trace])

    def _mark(self, wave: int, step: str) -> None:
        if self.trace is not None:
            self.trace.append((wave, step, time.perf_counter()))

    def _slot_free(self, slot: int) -> bool:
        """Whether the receiver has returned the slot's credit and this side's last write from it has ended."""
        handle = self.local_write[slot]
        return self.remote_free[slot] and (handle is None or handle.state != "PROC")

    def _gather(self, wave: Wave) -> None:
        """Gather a wave into its slot: the batch-wide offsets, shifted onto the slot (no per-wave tensors)."""
        ep = self.ep
        slot_lo = self.local_base + wave.slot * self.slot_bytes
        shift = slot_lo - wave.byte_lo
        descs, offsets = self.device_descs[wave.lo : wave.hi], self.dev_starts[wave.lo : wave.hi]
        typical = max(1, wave.nbytes // max(1, wave.hi - wave.lo))
        self.remote_free[wave.slot] = False
        if ep.stream is not None:
            with torch.cuda.stream(ep.stream):
                gather(descs, offsets, ep.staging, self.alignment, typical_bytes=typical, need=slot_lo + wave.nbytes,
                       shift=shift)
                event = torch.cuda.Event()
                event.record(ep.stream)
        else:
            gather(descs, offsets, ep.staging, self.alignment, typical_bytes=typical, need=slot_lo + wave.nbytes,
                   shift=shift)
            event = None
        self.gathered.append((wave, event))
        self.next_wave += 1
        self.writes[wave.index] = self._write_args(wave)
        self._mark(wave.index, "gather")

    def _write_args(self, wave: Wave) -> tuple[np.ndarray, bytes]:
        """A wave's region (from its slot here to the same slot there) and notification. Made when it
        is gathered: a gather queued ahead of its mark then leaves only the engine's post on the path."""
        slot_lo = wave.slot * self.slot_bytes
        return (np.array([[self.ep.staging.data_ptr() + self.local_base + slot_lo, self.peer.staging[0] + slot_lo,
                           wave.nbytes]],
                         np.uint64), self.peer.sealed(wave_note(self.base_id + wave.index, self.ep.id)))

    def _pump(self) -> bool:
        """Post gathered waves whose gather has finished; take in credits; progress writes. Whether
        anything moved (or a gather is still running on the device, which ends within microseconds)."""
        ep = self.ep
        before = (len(self.posted), len(self.acked), len(self.gathered))
        while self.gathered and (self.gathered[0][1] is None or self.gathered[0][1].query()):
            wave, _ = self.gathered.pop(0)
            self._mark(wave.index, "gathered")  # seen done: what follows is the engine's post
            self._post(wave)
        while (msg := self.peer.channel.try_recv()) is not None:
            kind, header, _ = msg
            if kind != Kind.WAVE_DONE:  # e.g. the next requests' lists: kept for receive_requests
                self.peer.backlog.append(msg)
                continue
            self.on_credit(header)
        # credits through the engine are looked for only while some are due: a loop that asks the engine
        # for notifications while it waits for a gather contends for the UCX worker with NIXL's progress
        # thread, and the next post waits for it (benchmarks/post_cost.py)
        if self.own_notes and self.wants_notes():
            for _, raw in self.take_notes(ep.engine.notifications()):
                log.warning("refused an engine notification that is not sealed by this run's decode: %r", raw[:80])
        for wave, handle in self.posted.values():
            if handle.state == "PROC":
                ep.engine.progress(handle)
        return bool(self.gathered) or before != (len(self.posted), len(self.acked), len(self.gathered))

    def on_credit(self, header: dict[str, Any]) -> None:
        """A credit the receiver sent on the control channel (``wave``, and ``error`` if it refused the wave)."""
        try:
            self._credit(int(header["wave"]), header.get("error"))
        except (KeyError, TypeError, ValueError, OverflowError):
            log.warning("ignored a malformed credit from the decode side: %r", header)

    def overlaps(self, other: StagedRun) -> bool:
        """Whether this run's part of the staging buffer here and ``other``'s share a byte."""
        mine = (self.local_base, self.local_base + self.slots * self.slot_bytes)
        theirs = (other.local_base, other.local_base + other.slots * other.slot_bytes)
        return mine[0] < theirs[1] and theirs[0] < mine[1]

    def wants_notes(self) -> bool:
        """Whether credits due to this run come as engine notifications (its receiver sends them so, and
        some posted wave is not acknowledged yet)."""
        return self.peer.credits_by_engine and len(self.acked) < len(self.posted)

    def take_notes(self, notes: Sequence[tuple[Any, bytes]]) -> list[tuple[Any, bytes]]:
        """Take the credits among the engine's ``notes`` (``(origin, bytes)``) that this run's decode sealed;
        the others, as they came (another run's, or forged)."""
        left = []
        for note in notes:
            raw = note[1]
            opened = self.peer.opened(raw)
            if opened is None:  # (another decode's, forged or replayed)
                left.append(note)
                continue
            wave_id = decode_credit(opened)
            if wave_id is None:
                log.warning("ignored an engine notification that is no credit: %r", raw[:80])
            elif self.base_id <= wave_id < self.base_id + len(self.waves):
                self._credit(wave_id, None)
            else:  # another run's (without a secret a note opens for every run: its wave says whose it is)
                left.append(note)
        return left

    def _credit(self, wave_id: int, error: Any) -> None:
        """Wave ``wave_id``'s slot is free again (the receiver scattered it, or refused it with ``error``)."""
        index = wave_id - self.base_id
        if index not in self.posted:
            if error and 0 <= index < len(self.waves):  # refused before it was posted: it never will be
                self.ep.verbs.fail(self.dest, self.result, self.waves[index].requests(self.owners),
                              f"the receiver refused the wave: {error}")
            return
        wave, _ = self.posted[index]
        self.acked.add(index)
        self._mark(index, "ack")
        self.remote_free[wave.slot] = True
        if error:
            self.ep.verbs.fail(self.dest, self.result, wave.requests(self.owners), f"the receiver refused the wave: {error}")

    def _post(self, wave: Wave) -> None:
        try:
            self._write(wave)
        finally:
            if self.deferred is not None:
                self._send_deferred()

    def _send_deferred(self) -> None:
        """Send the waves held back until the first wave was posted (see :meth:`announce`)."""
        header, self.deferred = self.deferred, None
        try:
            self.peer.channel.send(Kind.STAGED_WAVES, header, timeout=max(0.0, self.deadline - time.monotonic()))
        except ControlTimeout as err:
            self.gone = self.gone or str(err)
            self.ep.verbs.fail(self.dest, self.result, list(self.result), str(err))
            return
        self._mark(0, "tables")

    def _write(self, wave: Wave) -> None:
        ep = self.ep
        if any(v is not None for v in self.result.values()) and \
                all(self.result[r] is not None for r in wave.requests(self.owners)):
            self.remote_free[wave.slot] = True  # every request of it has failed already: nothing to write
            return
        region, note = self.writes.pop(wave.index, None) or self._write_args(wave)
        handle = ep.engine.post(self.peer.name, region, note, reuse=("slot", wave.slot, wave.nbytes))
        self._mark(wave.index, "post")
        self.posted[wave.index] = (wave, handle)
        self.local_write[wave.slot] = handle
