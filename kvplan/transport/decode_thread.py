"""The decode endpoint's progress thread: where published lists are finished and sent, engine
notifications and staged waves are taken in, deadlines and fences are kept, off the caller's thread
(:meth:`DecodeEndpoint.start`).

**Who owns what.** Once started, this thread alone touches the endpoint's control channels, its
engine, its tracker and its landing guard. The caller's thread launches the destination-list kernels
of a ``publish`` (on its own stream, never waiting for them) and enqueues the rest; it enqueues
aborts, refusals and forgets; it reads what ended (:meth:`take_ended`, a dict swapped under one lock
held for that swap), fences (a dict read, written only here) and counters. No call of the caller
waits for a peer or for the device.

**A publish** is finished here in the order published: once its kernels' event has passed (asked,
never waited for), its lists are checked (a bad one fails every request of that publish with the
error that names it; nothing of them is sent), tracked, and sent to their senders.

**Between looks** at the engine and the channels it waits as :mod:`.pause` describes, blocking on
the channels' sockets and a wake-up pipe (a message or a call of the caller wakes it at once) for a
slice that grows to 1 ms while anything is in flight and to :data:`IDLE_S` once nothing is (then
only a message can arrive). It never spins, and it leaves Python's lock to the caller while it waits.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Any, Callable, Protocol, Sequence

from ..errors import KvplanError
from ..profiling import Profile
from .pause import FIRST_S, LONGEST_S, hot_seconds
from .wake import WakePipe



class ReceivingEndpoint(Protocol):
    """What the thread drives of the :class:`~kvplan.transport.decode.DecodeEndpoint` it belongs to:
    its channels and completion tracker, one poll of both, the publications it queued, and its pacing."""

    channels: list
    tracker: Any
    _gone_senders: set
    _waves: dict
    _pause: Any

    def _poll(self) -> None: ...

    def _finished(self, ended: dict) -> dict: ...

    def _finish_publish(self, pending: Any, requests: Sequence[Any], deadline: float, peers: Any,
                        publishers: Any) -> None: ...

__all__ = ["DecodeProgress", "IDLE_S"]

log = logging.getLogger(__name__)

IDLE_S = 0.02  # the longest the thread blocks while nothing is in flight (only a message can come then)


class _Publish:
    __slots__ = ("pending", "requests", "deadline", "peers", "publishers")

    def __init__(self, pending, requests, deadline, peers, publishers):
        self.pending, self.requests, self.deadline = pending, requests, deadline
        self.peers, self.publishers = peers, publishers


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
        self._wakeup = WakePipe()
        self._hot_s = hot_seconds()
        self._slice = FIRST_S
        self.thread = threading.Thread(target=self._run, name="kvplan-decode-progress", daemon=True)
        self.thread.start()

    # -- the caller's side -------------------------------------------------------------------------
    def publish(self, pending: Any, requests: Sequence[Any], deadline: float, peers: tuple[int, ...],
                publishers: int) -> None:
        self._published += 1
        self._queue.append(_Publish(pending, tuple(requests), deadline, peers, publishers))
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
        """Whether the queue's head can run now (a publish once its kernels have run)."""
        if not self._queue:
            return False
        head = self._queue[0]
        return not isinstance(head, _Publish) or head.pending.event is None or head.pending.event.query()

    def _run_queue(self) -> bool:
        ran = False
        while self._ready():
            item = self._queue.popleft()
            ran = True
            if isinstance(item, _Publish):
                self._finished += 1
                self._finish(item)
                continue
            try:
                item()
            except Exception:  # noqa: BLE001 - one action's failure must not stop the thread
                log.exception("a queued decode action failed")
        return ran

    def _finish(self, p: _Publish) -> None:
        try:
            self.ep._finish_publish(p.pending, p.requests, p.deadline, p.peers, p.publishers)
        except KvplanError as err:  # a list the kernels refused: none of this publish is sent
            reason = f"its destination lists were refused: {err}"
            log.error("%s", reason)
            with self._ended_cv:
                self._ended.update({r.request: reason for r in p.requests})
                self._ended_cv.notify_all()
            self.ep.tracker.stats.failed(reason, len(p.requests))

    def _pause(self) -> None:
        """Block until a channel or the caller wakes this thread, or one slice has passed."""
        ep = self.ep
        quiet = time.monotonic() - ep._pause._last
        if quiet < self._hot_s:  # (the next wave or note is close: a short sleep, which leaves the lock to the caller)
            self._slice = FIRST_S
            time.sleep(FIRST_S)
            return
        moving = self._queue or ep.tracker.in_flight or ep._waves
        longest = LONGEST_S if moving else IDLE_S
        self._slice = min(2 * self._slice, longest)
        if self._slice < 1e-3:
            time.sleep(self._slice)
            return
        self._wakeup.wait(ep.channels, self._slice)
