"""The decode endpoint's progress thread: where published lists are finished and sent, engine
notifications and staged waves are taken in, deadlines and fences are kept, off the caller's thread
(:meth:`DecodeEndpoint.start`).

**Who owns what.** Once started, this thread alone touches the endpoint's control channels, its
engine, its tracker and its landing guard. The caller's thread launches the destination-list kernels
of a ``publish`` (on its own stream, never waiting for them) and enqueues the rest; it enqueues
aborts, refusals and forgets; it reads what ended (:meth:`take_ended`, a dict swapped under one lock
held for that swap), fences (a dict read, written only here) and counters. No call of the caller
waits for a peer or for the device.

**A publish** is checked on the caller's thread (what its lengths show: a bad request raises there)
and queued with an event on the caller's stream. The thread launches the destination-list kernels
of every publish queued in one turn together, behind those events; once the launch's event has
passed (asked, never waited for) each publish's lists are checked (a bad one fails every request of
that publish with the error that names it; nothing of them is sent), tracked, and sent to their
senders, in the order published.

**Between looks** at the engine and the channels it blocks in one wait (:mod:`.runtime.loop`) on the
channels' sockets, the engine's descriptors where it has some (``ipc``'s notification socket) and its
wake-up (a message, a notification or a call of the caller wakes it at once). While anything is in
flight that signals nothing (NIXL's and Mooncake's notifications, a publish's or a scatter's kernels)
the wait lasts one slice of the poll cadence (50 µs after the last progress, up to 1 ms); with
nothing in flight, up to :data:`~.runtime.loop.IDLE_S`. It never spins, and it leaves Python's lock
to the caller while it waits.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Any, Callable, Protocol, Sequence

import torch

from ..errors import KvplanError
from ..planner.device.destinations import plan_destinations
from ..profiling import Profile
from .runtime.loop import IDLE_S, name_thread, Wakeup, engine_fds, wait_ready



class ReceivingEndpoint(Protocol):
    """What the thread drives of the :class:`~kvplan.transport.decode.DecodeEndpoint` it belongs to:
    its channels and completion tracker, one poll of both, the publications it queued, and its pacing."""

    channels: list
    engine: Any
    side: Any
    tracker: Any
    _gone_senders: set
    _waves: dict
    _pause: Any

    def _poll(self) -> None: ...

    def _finished(self, ended: dict) -> dict: ...

    def _finish_publish(self, pending: Any, requests: Sequence[Any], deadline: float, peers: Any,
                        publishers: Any) -> None: ...

    def _finish_published(self, published: Sequence[Any], messages: Sequence[bytes], requests: Sequence[Any],
                          deadline: float, peers: Any, publishers: Any) -> None: ...

__all__ = ["DecodeProgress"]

log = logging.getLogger(__name__)


class _Publish:
    """A queued publish; ``pending``: its lists' launch (shared by the publishes launched with it), ``None``
    until launched; ``ready``: the caller's event it waits for on the device."""

    __slots__ = ("pending", "requests", "deadline", "peers", "publishers", "ready")

    def __init__(self, pending, requests, deadline, peers, publishers, ready=None):
        self.pending, self.requests, self.deadline = pending, requests, deadline
        self.peers, self.publishers, self.ready = peers, publishers, ready


def plan_lists(side: Any, requests: Sequence[Any], after: Sequence[Any] = ()) -> Any:
    """Launch the destination-list kernels of ``requests`` on this thread's stream, behind the caller's
    events ``after`` (:func:`~.streams.caller_event`)."""
    table = side.req_to_token
    if isinstance(table, torch.Tensor) and table.is_cuda:
        stream = torch.cuda.current_stream(table.device)
        for event in after:
            if event is not None:
                stream.wait_event(event)
    return plan_destinations(side, requests)


class _Launch:
    """The destination-list kernels of one or more publishes, launched together."""

    __slots__ = ("pending",)

    def __init__(self, pending: Any):
        self.pending = pending

    def ready(self) -> bool:
        return self.pending.event is None or self.pending.event.query()


class DecodeProgress:
    """The thread of one :class:`~kvplan.transport.decode.DecodeEndpoint` (see the module docstring)."""

    def __init__(self, endpoint: ReceivingEndpoint):
        self.ep = endpoint
        # the caller's publishes and actions, in the order it made them: an abort or a forget queued after
        # a publish runs once that publish is finished (it then finds the request tracked)
        self._queue: deque[_Publish | Callable[[], None]] = deque()
        self._published = 0  # publishes queued (counted by the caller) ...
        self._finished = 0  # ... and finished (counted here): each counter has one writer
        self._ended_cv = threading.Condition()  # guards _ended (held for one update or one swap)
        self._ended: dict[Any, str | None] = {}
        self.gone: frozenset[int] = frozenset()  # senders whose connection was lost, as of the last look
        self._closing = False
        self._wakeup = Wakeup()
        self.thread = threading.Thread(target=self._run, name="kvplan-decode-progress", daemon=True)
        self.thread.start()

    # -- the caller's side -------------------------------------------------------------------------
    def publish(self, requests: Sequence[Any], deadline: float, peers: tuple[int, ...], publishers: int,
                ready: Any = None) -> None:
        """Queue a publish (checked by the caller); ``ready``: an event on the caller's stream its kernels
        wait for."""
        self._published += 1
        self._queue.append(_Publish(None, tuple(requests), deadline, peers, publishers, ready))
        self._wake()

    def call(self, action: Callable[[], None]) -> None:
        """Run ``action`` on this thread, in the order given."""
        self._queue.append(action)
        self._wake()

    def here(self) -> bool:
        return threading.current_thread() is self.thread

    def take_ended(self) -> dict[Any, str | None]:
        with self._ended_cv:
            ended, self._ended = self._ended, {}
        return ended

    def wait_ended(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until some request has ended; whether one has."""
        with self._ended_cv:
            if not self._ended:
                self._ended_cv.wait(max(0.0, timeout))
            return bool(self._ended)

    def pending_publishes(self) -> int:
        return self._published - self._finished

    def close(self, timeout: float = 5.0) -> None:
        """Stop: what was queued runs first, but for publishes whose kernels have not run (dropped: nothing of
        them was sent)."""
        self._closing = True
        self._wake()
        self.thread.join(timeout)
        self._wakeup.close()

    def _wake(self) -> None:
        self._wakeup.wake()

    # -- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        name_thread("kvplan-decode")
        with Profile(f"decode-progress-{os.getpid()}"):  # (KVPLAN_PROFILE names a folder)
            self._loop()

    def _loop(self) -> None:
        ep = self.ep
        while not self._closing:
            try:
                busy = self._run_queue()
                ep._poll()
                self.gone = frozenset(ep._gone_senders)
                ended = ep._finished(ep.tracker.take_ended())
                if ended:
                    with self._ended_cv:
                        self._ended.update(ended)
                        self._ended_cv.notify_all()
                    busy = True
            except Exception:  # noqa: BLE001 - the thread must live on: what failed is logged, the rest goes on
                log.exception("the decode endpoint's progress thread caught an error")
                busy = True
            if busy:
                ep._pause.busy()
            if not self._ready():
                self._pause()
        while self._queue:  # what the caller queued before close(): publishes whose kernels have not run are dropped
            if self._ready():
                self._run_queue()
            else:
                self._queue.popleft()
                self._finished += 1

    def _ready(self) -> bool:
        """Whether the queue's head can run now (a publish once its kernels, launched by :meth:`_run_queue`,
        have run)."""
        if not self._queue:
            return False
        head = self._queue[0]
        if not isinstance(head, _Publish):
            return True
        return head.pending is not None and (not isinstance(head.pending, _Launch) or head.pending.ready())

    def _launch(self) -> None:
        """Launch the lists' kernels of the queued publishes from the head up to the first action, together."""
        group = []
        for k in range(len(self._queue)):  # (by index: the caller appends meanwhile)
            item = self._queue[k]
            if not isinstance(item, _Publish) or item.pending is not None:
                break
            group.append(item)
        requests = [r for p in group for r in p.requests]
        try:
            launch = _Launch(plan_lists(self.ep.side, requests, [p.ready for p in group]))
        except KvplanError:  # (the caller checked each: a table changed since) each alone names its own error
            for p in group:
                try:
                    p.pending = _Launch(plan_lists(self.ep.side, p.requests))
                except KvplanError as err:
                    p.pending = err
            return
        for p in group:
            p.pending = launch

    def _run_queue(self) -> bool:
        ran = False
        while True:
            if self._queue and isinstance(self._queue[0], _Publish) and self._queue[0].pending is None:
                self._launch()
                ran = True
            if not self._ready():
                break
            item = self._queue.popleft()
            ran = True
            if isinstance(item, _Publish):
                group = [item]
                while self._queue and isinstance(self._queue[0], _Publish) and self._queue[0].pending is item.pending:
                    group.append(self._queue.popleft())
                self._finished += len(group)
                self._finish(group)
                continue
            try:
                item()
            except Exception:  # noqa: BLE001 - one action's failure must not stop the thread
                log.exception("a queued decode action failed")
        return ran

    def _finish(self, group: list[_Publish]) -> None:
        """Track and send the publishes launched together (``group``), each failing alone where its lists
        were refused."""
        pending = group[0].pending
        if isinstance(pending, KvplanError):
            self._refuse(group[0], pending)
            return
        try:
            published, messages = pending.pending.result(), pending.pending.messages()
        except KvplanError as err:
            if len(group) == 1:
                self._refuse(group[0], err)
                return
            for p in group:  # (one list was refused: each publish planned again alone names its own)
                try:
                    alone = plan_lists(self.ep.side, p.requests)
                    self.ep._finish_publish(alone, p.requests, p.deadline, p.peers, p.publishers)
                except KvplanError as one:
                    self._refuse(p, one)
            return
        at = 0
        for p in group:
            n = len(p.requests)
            self.ep._finish_published(published[at : at + n], messages[at : at + n], p.requests, p.deadline, p.peers,
                                      p.publishers)
            at += n

    def _refuse(self, p: _Publish, err: KvplanError) -> None:
        """A list the kernels refused: none of this publish is sent."""
        reason = f"its destination lists were refused: {err}"
        log.error("%s", reason)
        with self._ended_cv:
            self._ended.update({r.request: reason for r in p.requests})
            self._ended_cv.notify_all()
        self.ep.tracker.stats.failed(reason, len(p.requests))

    def _pause(self) -> None:
        """Block until a channel, the engine or the caller wakes this thread, or for one slice of the
        poll cadence while something signal-less is in flight (up to ``IDLE_S`` while nothing is)."""
        ep = self.ep
        if self._queue or ep.tracker.in_flight or ep._waves:
            ep._pause(ep.channels, self._wakeup)
        else:
            wait_ready(ep.channels, engine_fds(ep.engine), IDLE_S, self._wakeup)
