"""A decode endpoint's staged receiving (:class:`StagedReceiver`, a part of
:class:`~kvplan.transport.decode.DecodeEndpoint`): a staged run announced ahead of its bytes, with the
sender's destination table (checked against what was published, :mod:`..landing`) or by its chunks alone
(this side plans the scatter, :mod:`..receiver_plan`); each wave scattered on the endpoint's stream once
its engine notification says it landed, and its slot's credit returned once the scatter has finished."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ...errors import PeerError
from ...kernels.copy import launch_shape
from ...planner.device.planner import Planner
from ...planner.contract.batch import Batch
from ..completion import SectionNote, note_of
from ..control import ControlTimeout
from ..copy_graphs import capture_copy, upload_graph
from ..engines import TransferError
from ..local import plan_alignment, scatter
from ..note_seal import sealed
from ..receiver_plan import OwnLists, PlannedRun, PlannedWave
from ..waves import check_run, credit_note, wave_key
from ..control_messages import Kind

__all__ = ["StagedReceiver"]

log = logging.getLogger(__name__)

POLL_S = 0.001  # how long one look at the control socket blocks before the engine is looked at again
GRAPH_WAVES = 4  # a table run of at most this many waves has its scatters captured when announced
EARLY_KEEP_S = 60.0  # how long a landed wave waits for its table (a refused or lost run's never comes)


@dataclass
class _StagedWave:
    """A wave announced by the sender: where it lies in the staging buffer, its rows of the run's
    scatter inputs, its sections."""

    index: int
    peer: int  # the channel it came on (its credit goes back there)
    lo: int  # in this side's staging buffer
    nbytes: int
    alignment: int
    row_lo: int  # its rows of the run's table
    row_hi: int
    sections: list[SectionNote]
    requests: list[Any]
    inputs: Any  # the run's scatter inputs on the device: [2n + 1, 3] int64 (descriptors, then offsets)
    keep: Any = None  # their pinned host rows, alive until the upload has run
    run: PlannedRun | None = None  # a planned run's (this side plans the scatter; no table, no inputs)
    planned: PlannedWave | None = None  # ... and the wave's place in it
    landed: bool = False
    event: Any = None  # the scatter's CUDA event once launched
    scattered: bool = False
    graph: Any = None  # its scatter captured when announced (a table run's), replayed when it lands


class StagedReceiver:
    """The staged half of :class:`~kvplan.transport.decode.DecodeEndpoint` (its state lives on the endpoint)."""

    def _announce(self, peer: int, header: dict[str, Any], table: bytes) -> None:
        """Check a staged run's tables against what this side published before anything is written,
        then upload every wave's scatter inputs ahead of its bytes (see :func:`~.waves.run_message`).
        A run that is malformed or writes outside what was published is refused whole."""
        requests: list[Any] = []
        waves: list = []
        try:
            sender = str(header["from"])
            spans = [(r, int(lo), int(hi)) for r, lo, hi in header["requests"]]  # first: a refusal fails them
            requests = list(dict.fromkeys(r for r, _, _ in spans))
            waves = [[int(i), int(slot_lo), int(lo), int(hi), int(n), [note_of(fields) for fields in notes]]
                     for i, slot_lo, lo, hi, n, notes in header["waves"]]
            if waves:
                self._mark(wave_key(waves[0][0], sender), "received")
            alignment = int(header["alignment"])
            strangers = [r for r in requests if r in self._owner and not self._writes(r, peer)]
            if strangers:
                raise PeerError(f"the run names requests published to another sender: {strangers[:4]}")
            if self.staging is None:
                raise PeerError("a staged run arrived, but this side registered no staging buffer")
            rows = np.frombuffer(table, dtype=np.uint64).reshape(-1, 2)
            check_run(rows, spans, waves, alignment, self._share)
            self.guard.check_spans(spans, rows)
            self.guard.check_notes(spans, rows, [note for *_, notes in waves for note in notes])
            if waves:
                self._mark(wave_key(waves[0][0], sender), "checked")
        except (PeerError, KeyError, TypeError, ValueError, IndexError, OverflowError) as err:
            why = str(err) if isinstance(err, PeerError) else f"a malformed announcement ({type(err).__name__}: {err})"
            self._refuse_run(peer, requests, [w[0] for w in waves], why)
            return
        host, inputs = self._stage_inputs(rows, waves, peer * self._share)
        owner_ends = np.array([hi for _, _, hi in spans], np.int64)
        for index, lo_in_slot, lo, hi, nbytes, notes in waves:
            key = wave_key(index, sender)
            first, last = np.searchsorted(owner_ends, [lo, hi - 1], side="right") if hi > lo else (0, -1)
            self._waves[key] = _StagedWave(index, peer, lo_in_slot + peer * self._share, nbytes, alignment, lo, hi,
                                           notes, [spans[k][0] for k in range(int(first), int(last) + 1)], inputs,
                                           host, landed=key in self._early)
            self._early.pop(key, None)
            if len(waves) <= GRAPH_WAVES:
                self._waves[key].graph = self._capture(self._waves[key])
            self._mark(key, "table")

    def _announce_planned(self, peer: int, header: dict[str, Any]) -> None:
        """Start planning a planned run's scatter from what this side published (see
        :mod:`.receiver_plan`); a run that names what this side cannot plan is refused whole. A run
        announced by its chunks alone (a ``run`` id, no ``waves``) waits for its ``staged-waves``."""
        requests: list[Any] = []
        waves: list = []
        early, key = "waves" not in header, None
        try:
            sender = str(header["from"])
            waves = [] if early else [int(w[0]) for w in header["waves"]]
            if waves:
                self._mark(wave_key(waves[0], sender), "received")
            if early:
                key = (peer, int(header["run"]))
                self._mark(f"{sender}:run{key[1]}", "received")
            requests = list(dict.fromkeys(r for r, *_ in header["transfers"]))
            strangers = [r for r in requests if r in self._owner and not self._writes(r, peer)]
            if strangers:
                raise PeerError(f"the run names requests published to another sender: {strangers[:4]}")
            if self.staging is None:
                raise PeerError("a staged run arrived, but this side registered no staging buffer")
            if peer not in self._scatter_from:
                raise PeerError("a run announced without destination tables, from a sender whose layout this side "
                                "cannot plan a scatter for (not paired, or of other page sizes or policy)")
            planner, alignment = self._scatter_planner(peer)
            run = PlannedRun.announce(header, self._share, self._own_lists, planner, self._stream, alignment)
        except (PeerError, KeyError, TypeError, ValueError, IndexError, OverflowError) as err:
            why = str(err) if isinstance(err, PeerError) else \
                f"a malformed or unplannable run ({type(err).__name__}: {err})"
            self._refuse_run(peer, requests, waves, why)
            if key is not None:
                self._chunked[key] = why  # its waves are refused when they come
            return
        if early:
            self._chunked[key] = run
            self._mark(f"{sender}:run{key[1]}", "planning")
            return
        self._start_waves(peer, run)

    def _on_run_waves(self, peer: int, header: dict[str, Any]) -> None:
        """The waves of a run announced by its chunks (``staged-waves``): checked, then scattered as
        they land; a cancelled run is dropped (its sender failed it), an unknown or refused one's
        waves are refused."""
        try:
            key = (peer, int(header["run"]))
            run = self._chunked.pop(key, None)
            if "cancel" in header:
                return
            waves = [int(w[0]) for w in header["waves"]]
        except (KeyError, TypeError, ValueError, IndexError, OverflowError) as err:
            log.warning("ignored a malformed staged-waves message from sender %d: %s: %s", peer, type(err).__name__,
                        err)
            return
        if run is None or isinstance(run, str):
            self._refuse_run(peer, [], waves, run or "waves of a run this side was not announced")
            return
        try:
            run.set_waves(header["waves"], self._share)
        except (PeerError, TypeError, ValueError, IndexError, OverflowError) as err:
            self._refuse_run(peer, run.requests, waves, str(err) if isinstance(err, PeerError) else
                             f"malformed waves ({type(err).__name__}: {err})")
            return
        self._start_waves(peer, run)

    def _start_waves(self, peer: int, run: PlannedRun) -> None:
        """A planned run's waves become scatterable as they land once its plan is placed."""
        share_lo = peer * self._share
        sender = run.sender
        for w in run.waves:
            key = wave_key(w.index, sender)
            self._waves[key] = _StagedWave(w.index, peer, share_lo + w.lo_in_share, w.nbytes, run.alignment, 0, 0, [],
                                           run.requests, None, run=run, planned=w, landed=key in self._early)
            self._early.pop(key, None)
            self._mark(key, "table")
        self._runs.append((peer, run))

    def _own_lists(self, request: Any) -> OwnLists:
        """What this side published for a request a planned run names: its row, lengths and lists (only the
        chunks' bounds come from the peer, and planning checks them)."""
        known = self._own.get(request)
        if known is None or request not in self.tracker:
            raise PeerError(f"the run names request {request!r}, which this side has not published with a row "
                            "(or has already settled)")
        return known

    def _scatter_planner(self, peer: int) -> tuple[Planner, int]:
        """The planner of sender ``peer``'s runs and their copy word (the announced one is capped by it)."""
        source = self._scatter_from[peer]
        if source is self.side:  # its bytes fill whole items: planned from this side to itself
            if self._planner is None:
                # each run's plan is copied on the device right behind it, and its host report read once ready:
                # two buffers per sender keep a second run's plan from overwriting the first's report before
                # then (every buffer captures its own CUDA graph)
                self._planner = Planner(self.side, (self.side,), outputs=("descriptors", "byte_offsets"),
                                        depth=2 * len(self.channels))
            return self._planner, self._alignment
        if peer not in self._mirrors:  # a gather's part: from the sender's layout over this side's lists
            self._mirrors[peer] = (Planner(source, (self.side,), outputs=("descriptors", "byte_offsets"), depth=2),
                                   plan_alignment(Batch(source, (self.side,), ())))
        return self._mirrors[peer]

    def _advance_runs(self) -> None:
        """Planned runs whose plan or byte sums have finished become scatterable (or are refused)."""
        for peer, run in list(self._runs):
            planning = run.stage == "planning"
            done = run.advance(self._stream, when_ready=self._scatter_landed)  # landed waves first, then sections
            if planning and run.stage != "planning" and run.waves:
                self._mark(wave_key(run.waves[0].index, run.sender), "plan-ready")
            if not done:
                continue
            self._runs.remove((peer, run))
            keys = [wave_key(w.index, run.sender) for w in run.waves]
            if run.stage == "refused":
                for key in keys:
                    self._waves.pop(key, None)
                self._refuse_run(peer, run.requests, [w.index for w in run.waves], run.why)
                continue
            for key, w in zip(keys, run.waves):
                if key in self._waves:
                    self._waves[key].sections = [SectionNote(s.request, int(s.role), s.name, s.count)
                                                 for s in w.sections]
                    self._mark(key, "checked")

    def _refuse_run(self, peer: int, requests: Sequence[Any], waves: Sequence[int], why: str) -> None:
        """Fail a refused run's requests and tell its sender, wave by wave (no slot of it is scattered)."""
        for r in requests:
            if self._writes(r, peer):
                self.tracker.fail(r, f"refused staged run: {why}")
        for index in waves:
            self._tell(peer, {"wave": index, "error": why})

    def _stage_inputs(self, rows: np.ndarray, waves: list, share_lo: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every wave's scatter descriptors ``(0, dst, nbytes)`` and staging offsets, uploaded from pinned
        memory on the scatter stream now, so that a landing only launches its scatter."""
        n = len(rows)
        host = self._host_rows(share_lo, 3 * (2 * n + 1)).view(2 * n + 1, 3)
        out = host.numpy()
        out[:n, 0] = 0
        out[:n, 1:] = rows.view(np.int64)
        offsets = out[n:].reshape(-1)[:n]
        offsets[:1] = 0
        np.cumsum(rows[:-1, 1].view(np.int64), out=offsets[1:])  # offset in the run's byte stream
        for _, lo_in_slot, lo, hi, _, _ in waves:  # ... shifted onto each wave's slot
            if hi > lo:
                offsets[lo:hi] += share_lo + int(lo_in_slot) - int(offsets[lo])
        if self._stream is None:
            return host, host.clone()  # the kept buffer is rewritten by this sender's next run
        with torch.cuda.stream(self._stream):
            on_device = host.to(self.staging.device, non_blocking=True)
            uploaded = torch.cuda.Event()
            uploaded.record(self._stream)
        self._uploads[share_lo] = (self._uploads[share_lo][0], uploaded)
        return host, on_device

    def _host_rows(self, key: int, count: int) -> torch.Tensor:
        """``count`` int64 of a pinned buffer kept per sender, free once its last upload has run."""
        buffer, uploaded = self._uploads.get(key, (None, None))
        if buffer is None or buffer.numel() < count:
            buffer = torch.empty(max(count, 2 * (buffer.numel() if buffer is not None else 0)), dtype=torch.int64,
                                 pin_memory=self._stream is not None)
        elif uploaded is not None:
            uploaded.synchronize()  # the previous run's upload from it (long finished in practice)
        self._uploads[key] = (buffer, None)
        return buffer[:count]

    def _scatter_landed(self) -> None:
        for key, wave in list(self._waves.items()):
            if not wave.landed or wave.event is not None or wave.scattered or \
                    (wave.run is not None and wave.run.stage != "ready"):
                continue
            busy = [o.index for o in self._waves.values() if o.index < wave.index and o.landed and not o.scattered
                    and o.peer == wave.peer and wave.lo < o.lo + o.nbytes and o.lo < wave.lo + wave.nbytes]
            if busy:  # the sender wrote a slot before its credit came back
                self._refuse(wave, f"wave {wave.index} landed on staging bytes that wave {busy[0]} has not freed")
                del self._waves[key]
                continue
            self._mark(key, "launch")
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    if wave.graph is not None:
                        wave.graph.replay()
                    else:
                        self._scatter(wave)
                    wave.event = torch.cuda.Event()
                    wave.event.record(self._stream)
            else:
                self._scatter(wave)
                wave.event = True
            self._mark(key, "scatter")

    def _scatter(self, wave: _StagedWave) -> None:
        """Launch a landed wave's scatter on the current stream: from its run's rows of the uploaded
        table, or from this side's own plan of a planned run (offsets in the run, shifted onto the slot)."""
        if wave.run is not None:
            descs, offsets, window = wave.run.scatter_inputs(wave.planned)
            typical = max(1, wave.run.waves[-1].byte_hi // max(1, len(descs)))
            shift, need = wave.lo - wave.planned.byte_lo, wave.lo + wave.nbytes
            counted = wave.run.scatter_counted() if self._copy_graphs is not None else None
            if counted is None:
                scatter(descs, offsets, self.staging, wave.alignment, typical_bytes=typical, need=need, shift=shift,
                        window=window)
                return
            # a one-wave run over its plan's buffers, counted on the device: a graph once its buffers recur
            self._copy_graphs.run(
                ("scatter", counted.descs.data_ptr(), counted.byte_offsets.data_ptr(), counted.rows.data_ptr(),
                 counted.descs.shape[0], launch_shape(typical, wave.alignment), wave.alignment, shift,
                 self.staging.data_ptr()),
                lambda: scatter(counted.descs, counted.byte_offsets, self.staging, wave.alignment, typical_bytes=typical,
                                need=need, shift=shift, rows=counted.rows))
            return
        n_all = (wave.inputs.shape[0] - 1) // 2
        descs = wave.inputs[wave.row_lo : wave.row_hi]
        offsets = wave.inputs[n_all:].reshape(-1)[wave.row_lo : wave.row_hi]
        typical = max(1, wave.nbytes // max(1, wave.row_hi - wave.row_lo))
        scatter(descs, offsets, self.staging, wave.alignment, typical_bytes=typical, need=wave.lo + wave.nbytes)

    def _capture(self, wave: _StagedWave) -> Any:
        """The wave's scatter as a CUDA graph (captured, not run), or ``None`` where there are no graphs.
        A capture that fails turns graphs off for this endpoint: its waves are then launched as
        before (a kernel compiled for the first time inside a capture, say). kvplan's own errors
        (a wave that does not fit its checks) are not capture failures: they propagate."""
        if not self._graphs:
            return None
        graph = capture_copy(lambda: self._scatter(wave), self._capture_stream, "scatters")
        self._graphs = graph is not None
        if graph is not None and self._upload:  # its first (only) replay then launches at once
            upload_graph(graph, self._stream)
        return graph

    def _refuse(self, wave: _StagedWave, why: str) -> None:
        """Fail a wave's requests and tell its sender (its slot is not credited back)."""
        for r in wave.requests:
            if self._writes(r, wave.peer):
                self.tracker.fail(r, f"refused staged wave {wave.index}: {why}")
        self._tell(wave.peer, {"wave": wave.index, "error": why})
        wave.scattered = True  # nothing of it is written

    def _credit(self, wave: _StagedWave) -> None:
        """Return a scattered wave's slot to its sender: through the engine where it takes them so,
        unless it is the last wave this side knows of from that sender. That one goes on the control
        channel, whose I/O thread delivers it by itself: a caller whose requests are all complete may stop
        polling, and an engine notification may need this side's polling to leave (NIXL without its
        progress thread sends one only while its worker is progressed)."""
        name = self._credit_to.get(wave.peer)
        last = not any(w.peer == wave.peer and not w.scattered for w in self._waves.values() if w is not wave)
        if name is not None and not last:
            try:
                self.engine.notify(name, sealed(self.channels[wave.peer], credit_note(wave.index)))
                return
            except TransferError as err:
                log.warning("a credit went through the control channel: the engine could not send it (%s)", err)
        self._tell(wave.peer, {"wave": wave.index})

    def _tell(self, peer: int, header: dict[str, Any]) -> None:
        """Send sender ``peer`` a wave's credit or refusal without blocking the poll loop: a sender that
        cannot take it within ``POLL_S`` is gone (killed, stopped), so its unsettled requests fail here
        instead of the loop raising (a dead sender once crashed this side after 11 s)."""
        try:
            self.channels[peer].send(Kind.WAVE_DONE, header, timeout=POLL_S)
        except ControlTimeout as err:
            log.warning("sender %d did not take a wave's %s: %s", peer, "refusal" if "error" in header else "credit",
                        err)
            self._fail_owned(peer, f"its sender stopped taking messages mid-transfer ({err})")

    def _mark(self, wave: str, step: str) -> None:
        if self.trace is not None:
            self.trace.append((wave, step, time.perf_counter()))

    def log_trace(self) -> None:
        """Log what ``KVPLAN_TRACE`` recorded since the last call (each wave's steps on the clock),
        then forget it. Logging takes long: call it once the timing that matters has been taken."""
        if self.trace:
            log.warning("decode waves (wave, step, clock ms): %s",
                        [(w.split(":")[-1], k, round(t * 1e3, 3)) for w, k, t in self.trace])
            self.trace.clear()

    def _finish_scatters(self) -> bool:
        """Credit and land every wave whose scatter has finished; whether any had."""
        done = [(k, w) for k, w in self._waves.items()
                if w.event is not None and not w.scattered and (w.event is True or w.event.query())]
        for key, wave in sorted(done, key=lambda kw: kw[1].index):
            wave.scattered = True
            self._mark(key, "done")
            self._credit(wave)  # before completion shows
            self._mark(key, "credit")
            self.tracker.on_sections(wave.sections, sender=wave.peer)
            self._mark(key, "noted")
            del self._waves[key]
        return bool(done)
