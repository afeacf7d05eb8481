"""The prefill endpoint's progress thread: where a submitted batch is planned, posted, waited for
and settled, off the caller's thread (:meth:`PrefillEndpoint.submit`).

**Who owns what.** Once an endpoint has a progress thread (its first ``submit``), that thread alone
touches its control channels, its engine and its planners: ZeroMQ sockets are not to be used from two
threads, and the engine's completions and fences must be read where the writes were posted. The
caller's thread only enqueues (batches, forgets, failures to report) and reads what the thread
published: the requests whose lists arrived, aborts, ended handles, counters. Each of those is a
``deque`` (appends and pops are atomic) or is guarded by one lock held for a few list operations,
never across a wait.

**Batches in flight.** Batches start (are planned and posted) in the order they were submitted, so
every peer sees its batches' writes posted in order. Up to :data:`MOVING` batches move at once: one
loop steps each one's writes, credits and deadline (:mod:`.runtime.moving`), reads the channels
between looks and starts the next batch as soon as one may; a batch's staged run to a peer starts
once that peer's run of an earlier batch has ended (:class:`~.senders.staged.StagedBatch`). A batch
streamed by layer groups starts only when nothing else moves. At most ``max_in_flight`` batches are
queued or moving at once; one more is refused at once with an ``overload`` reason for each of its
requests, nothing of it planned or sent, and each decode endpoint is told (it may release those pages
at once: no write of the batch exists). A queued batch keeps its deadline from the submit; one that
would start past it fails whole, sending nothing.

**Aborts and fences.** An abort is acknowledged (its fence) only while no write of its request is in
flight: an abort of a request in a moving batch is held until that batch has ended (and so is a
registration while any batch moves to its peer, and what follows a held message of the same request). A batch drops
the transfers of a request whose lists are gone (aborted or forgotten) when it starts, so an
acknowledged request is never written.

**Waiting.** Between looks the thread blocks in one wait (:mod:`.runtime.loop`) on the channels'
sockets, the engine's descriptors and its wake-up: a message, a submit or a queued action wakes it at
once; while writes are in flight it looks again within one slice of the poll cadence (50 us to 1 ms),
idle within :data:`~.runtime.loop.IDLE_S`. It never spins.

**Streams.** ``submit`` records an event on the caller's current CUDA stream; the thread's planning
waits for it on the device, so the batch sees every write the caller queued before the submit. The
bytes of a submitted batch, and its requests' token-table rows, must stay as they are until its
handle is done.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch

from .. import env
from ..errors import KvplanError, PlanError
from ..profiling import Profile
from .handles import SendHandle
from .streams import caller_event
from .runtime.loop import IDLE_S, name_thread, Cadence, Wakeup, engine_fds, wait_ready



class SendingEndpoint(Protocol):
    """What the thread drives of the :class:`~kvplan.transport.prefill.PrefillEndpoint` it belongs to:
    its side and peers, its channels' messages, the send itself, the failure reports and counters."""

    side: Any
    peers: list
    _pairing: list
    _stats: Any

    engine: Any
    refuse: str

    def _read_channels(self, busy: Any = ()) -> list[tuple[int, Any]]: ...

    def _start_send(self, transfers: Sequence[Any], mode: str, timeout: float, layers: Any,
                    submitted: float | None = None) -> Any: ...

    def _report(self, peer: int, request: Any, reason: str) -> None: ...

__all__ = ["MAX_IN_FLIGHT", "MOVING", "ProgressThread"]

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 8  # batches queued or moving at once per prefill endpoint (PrefillEndpoint's max_in_flight)
MAX_UNTOLD_REFUSALS = 65536  # refused requests waiting to be told to their decodes, at most
MOVING = 2  # batches planned and posted, not yet ended, at once: a plan's buffers stay its own for 2 plans


class _Job:
    __slots__ = ("handle", "transfers", "mode", "deadline", "layers", "ready", "moving", "dropped", "requests",
                 "started", "posted")

    def __init__(self, handle, transfers, mode, deadline, layers, ready):
        self.handle, self.transfers, self.mode = handle, transfers, mode
        self.deadline, self.layers, self.ready = deadline, layers, ready
        self.moving: Any = None  # its writes in flight, once started (runtime.moving.Moving)
        self.dropped: dict[Any, str] = {}  # requests aborted before it started
        self.requests: dict[int, set[Any]] = {}  # per peer, its requests (made when it starts)
        self.started = self.posted = 0.0  # when it started, and when its writes were posted (time.monotonic)


class ProgressThread:
    """The thread of one :class:`~kvplan.transport.prefill.PrefillEndpoint` (see the module docstring)."""

    def __init__(self, endpoint: SendingEndpoint, max_in_flight: int = MAX_IN_FLIGHT):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.ep, self.max_in_flight = endpoint, max_in_flight
        self._lock = threading.Lock()  # guards _jobs and _in_flight (held for a few list operations)
        self._arrivals = threading.Condition()  # (for receive_requests) notified when lists arrive
        self._jobs: deque[_Job] = deque()  # queued, not started
        self._moving: list[_Job] = []  # started, not ended (this thread's alone)
        self._cadence = Cadence()
        self._in_flight = 0  # batches queued or moving
        self._actions: deque[Callable[[], None]] = deque()  # the caller's, run here at the next turn
        # refused batches' requests whose decodes are to be told, all in one action however many are refused
        # (bounded: past it a decode fails the request at its own deadline, counted in `untold`)
        self._to_tell: deque[tuple[int, Any, str]] = deque()
        self.untold = 0
        self.arrived: deque[tuple[int, Any]] = deque()  # (peer, request) whose lists arrived
        self.errors: deque[BaseException] = deque()  # registrations refused (LayoutError), for the caller
        self.completed: deque[SendHandle] = deque()  # handles that ended, for PrefillEndpoint.completed()
        self._closing = False
        # KVPLAN_TRACE: each batch's (transfers, queued, planned and posted, moving) seconds, logged at close
        self._trace: list[tuple[int, float, float, float]] | None = [] if env.enabled("KVPLAN_TRACE") else None
        self._wakeup = Wakeup()
        self._thread = threading.Thread(target=self._run, name="kvplan-prefill-progress", daemon=True)
        self._thread.start()

    # -- the caller's side: enqueue and return --------------------------------------------------------
    def submit(self, handle: SendHandle, transfers: tuple, mode: str, timeout: float, layers: Any) -> None:
        ready = caller_event(self.ep.side.req_to_token)  # (what the caller queued before the submit)
        job = _Job(handle, transfers, mode, handle.submitted + timeout, layers, ready)
        with self._lock:
            admitted = self._in_flight < self.max_in_flight
            if admitted:
                self._in_flight += 1
                self._jobs.append(job)
        if not admitted:
            self._refuse(job)
        self._wake()

    def call(self, action: Callable[[], None]) -> None:
        """Run ``action`` on this thread at its next turn (between its looks at the moving batches), in the
        order given."""
        self._actions.append(action)
        self._wake()

    def take_arrivals(self, count: int, peer: int, deadline: float) -> int:
        """Wait (until ``deadline``) for ``count`` requests' lists from ``peer``; how many came."""
        taken = 0
        with self._arrivals:
            while taken < count:
                mine = [x for x in self.arrived if x[0] == peer][: count - taken]
                for x in mine:
                    self.arrived.remove(x)
                taken += len(mine)
                left = deadline - time.monotonic()
                if taken >= count or left <= 0:
                    break
                self._arrivals.wait(left)
        return taken

    def in_flight(self) -> int:
        return self._in_flight

    def moving(self) -> bool:
        """Whether a batch is moving (planned and posted, not ended)."""
        return bool(self._moving)

    def close(self, timeout: float = 5.0) -> None:
        """Stop once the batches moving have ended (or failed at their deadlines): queued actions still run,
        queued batches fail whole."""
        self._closing = True
        self._wake()
        self._thread.join(timeout)
        self._wakeup.close()
        self.log_trace()

    def _wake(self) -> None:
        self._wakeup.wake()

    def _refuse(self, job: _Job) -> None:
        """More than ``max_in_flight`` batches: this one is refused whole, nothing planned or sent."""
        reason = (f"overload: {self.max_in_flight} batches are already in flight at this prefill endpoint "
                  "(max_in_flight); nothing of this one was sent")
        self.ep._stats.failed(reason, len(job.handle.requests))
        told = list({(t.dest, t.request) for t in job.transfers})
        with self._lock:
            room = max(0, MAX_UNTOLD_REFUSALS - len(self._to_tell))
            first = not self._to_tell
            self._to_tell.extend((dest, request, reason) for dest, request in told[:room])
            over = len(told[room:])
            self.untold += over
        if over and self.untold == over:
            log.warning("more than %d refused requests wait to be told to their decodes: the rest fail there at "
                        "their deadlines (counted in untold)", MAX_UNTOLD_REFUSALS)
        if first:
            self.call(self._tell_refused)
        job.handle._finish({r: reason for r in job.handle.requests})
        self.completed.append(job.handle)

    def _tell_refused(self) -> None:
        """Tell each refused request's decode (one action for every refusal queued meanwhile)."""
        with self._lock:
            told, self._to_tell = self._to_tell, deque()
        for dest, request, reason in told:
            self.ep._report(dest, request, reason)

    # -- the thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        name_thread("kvplan-prefill")
        with Profile(f"prefill-progress-{os.getpid()}"):  # (KVPLAN_PROFILE names a folder)
            self._loop()

    def _loop(self) -> None:
        while not self._closing:
            moved = False
            try:
                self._run_actions()
                self._read_channels()
                moved = self._step()
                moved = self._start() or moved
            except Exception:  # noqa: BLE001 - the thread must live on: what failed is logged, the rest goes on
                log.exception("the prefill endpoint's progress thread caught an error")
            if moved:
                self._cadence.reset()  # (what moved a moment ago, a gather on the device, ends within microseconds)
            if self._actions or (self._jobs and self._may_start(self._jobs[0])):
                continue
            if self._moving:
                channels = self._channels() + [c for job in self._moving for c in job.moving.channels()]
                wait_ready(channels, engine_fds(self.ep.engine), self._cadence.next(), self._wakeup)
            else:
                self._wait(IDLE_S)
        self._run_actions()  # what the caller queued before close() (forgets, failures to report)
        while self._moving:  # (what was posted ends, or fails at its deadline, before the thread does)
            if not self._step():
                wait_ready([], engine_fds(self.ep.engine), self._cadence.next())
        while self._jobs:  # batches that never started: nothing of them was sent
            job = self._jobs.popleft()
            reason = "the prefill endpoint was closed before its batch was sent"
            for t in job.transfers:
                self.ep._report(t.dest, t.request, reason)
            job.handle._finish({r: reason for r in job.handle.requests})
            self.completed.append(job.handle)

    def _may_start(self, job: _Job) -> bool:
        """Whether the head of the queue may start now: fewer than :data:`MOVING` batches move, and none at
        all for a batch streamed by layer groups (it uses the whole staging ring)."""
        if not self._moving:
            return True
        # (refusing by request plans each request on its own: more plans a batch than the planner keeps)
        limit = 1 if self.ep.refuse == "request" else MOVING
        return len(self._moving) < limit and job.layers is None and all(j.layers is None for j in self._moving)

    def _start(self) -> bool:
        """Start the queued batches that may start; whether one did."""
        started = False
        while self._jobs and self._may_start(self._jobs[0]):
            job = self._jobs[0]
            started = True
            self._read_channels()  # (an abort that came since this turn's read drops its request from the batch)
            if self._begin(job):
                self._jobs.popleft()
                self._moving.append(job)
            else:
                self._end(self._jobs.popleft())
        return started

    def _step(self) -> bool:
        """One look at every moving batch; the ended ones end. Whether anything moved."""
        moved = False
        for job in list(self._moving):
            try:
                moved = job.moving.step() or moved
                if not job.moving.done():
                    continue
                job.handle._finish({**job.moving.result(), **job.dropped})
            except PlanError as err:
                job.handle._finish(error=err)
            except Exception as err:  # noqa: BLE001 - the caller sees it through result()
                log.exception("a submitted batch failed")
                job.handle._finish(error=err)
            self._moving.remove(job)
            self._end(job)
            moved = True
        return moved

    def _busy(self) -> dict[int, set[Any]]:
        """Per peer, the requests with writes of a moving batch to it."""
        if len(self._moving) == 1:
            return self._moving[0].requests
        busy: dict[int, set[Any]] = {}
        for job in self._moving:
            for dest, requests in job.requests.items():
                busy[dest] = busy.get(dest, set()) | requests
        return busy

    def _channels(self) -> list[Any]:
        return [p.channel for p in self.ep.peers] + [c for c, _ in self.ep._pairing]

    def _run_actions(self) -> bool:
        ran = False
        while self._actions:
            action = self._actions.popleft()
            ran = True
            try:
                action()
            except Exception:  # noqa: BLE001 - one action's failure must not stop the thread
                log.exception("a queued prefill action failed")
        return ran

    def _read_channels(self) -> bool:
        try:
            arrived = self.ep._read_channels(self._busy())
        except KvplanError as err:  # a registration that cannot pair: the caller's progress() raises it
            self.errors.append(err)
            return True
        if arrived:
            with self._arrivals:
                self.arrived.extend(arrived)
                self._arrivals.notify_all()
        return bool(arrived)

    def _begin(self, job: _Job) -> bool:
        """Plan and post ``job`` (its writes then in flight: ``job.moving``); ``False`` when it ended at once
        (its handle finished: refused, past its deadline, or nothing left to send)."""
        ep, handle = self.ep, job.handle
        try:
            if job.ready is not None:
                torch.cuda.current_stream(ep.side.req_to_token.device).wait_event(job.ready)
            # a request aborted (or forgotten) since it was submitted: its decode was told it is fenced
            gone = {t.request for t in job.transfers if t.request not in ep.peers[t.dest].lists}
            job.dropped = {r: "its decode endpoint aborted it before its batch was sent" for r in gone}
            transfers = tuple(t for t in job.transfers if t.request not in gone)
            left = job.deadline - time.monotonic()
            if left <= 0:
                reason = "deadline passed while its batch waited in the prefill endpoint's queue; nothing was sent"
                for t in transfers:
                    ep._report(t.dest, t.request, reason)
                ep._stats.failed(reason, len({t.request for t in transfers}))
                handle._finish({**{t.request: reason for t in transfers}, **job.dropped})
                return False
            if not transfers:
                handle._finish(dict(job.dropped))
                return False
            job.started = time.monotonic()
            job.moving = ep._start_send(transfers, job.mode, left, job.layers, handle.submitted)
            job.posted = time.monotonic()
            for t in transfers:
                job.requests.setdefault(t.dest, set()).add(t.request)
            return True
        except PlanError as err:
            handle._finish(error=err)
        except Exception as err:  # noqa: BLE001 - the caller sees it through result()
            log.exception("a submitted batch failed")
            handle._finish(error=err)
        return False

    def _end(self, job: _Job) -> None:
        with self._lock:
            self._in_flight -= 1
        self.completed.append(job.handle)
        if self._trace is not None and job.posted:
            self._trace.append((len(job.transfers), job.started - job.handle.submitted, job.posted - job.started,
                                time.monotonic() - job.posted))

    def log_trace(self) -> None:
        """Log what ``KVPLAN_TRACE`` recorded of the batches: how long each waited in the queue, took to plan
        and post, and moved, in milliseconds (p50 / p90 / p99), and its transfers."""
        if not self._trace:
            return
        rows = np.array(self._trace)
        parts = [f"{name} {' / '.join(f'{np.percentile(rows[:, k], q) * 1e3:.2f}' for q in (50, 90, 99))} ms"
                 for k, name in ((1, "queued"), (2, "planned and posted"), (3, "moving"))]
        log.warning("prefill batches (%d; p50 / p90 / p99): %s; transfers %d / %d / %d", len(rows), ", ".join(parts),
                    *(int(np.percentile(rows[:, 0], q)) for q in (50, 90, 99)))

    def _wait(self, timeout: float) -> None:
        """Block up to ``timeout`` until a control channel can be read or the caller wakes this thread."""
        wait_ready(self._channels(), (), timeout, self._wakeup)
