"""What every transfer engine offers kvplan's transport: post, poll, abort, notifications.

An engine moves ``[n, 3]`` uint64 descriptor arrays ``(src, dst, nbytes)`` to a connected peer.
:meth:`Engine.post` starts a write and returns a :class:`Handle` at once; the transport posts
every section first and then waits for all of them (:func:`wait_all`), so the engine's own
workers overlap them. Each posted write carries a notification that the receiver reads once its
bytes have landed. What an engine can do beyond that is declared in its :class:`Capabilities`
(prepared descriptor lists, array inputs), never probed with ``hasattr``.

A handle that misses its deadline is aborted, and :func:`wait_all` reports it failed only once the
engine says the handle has ended: no byte of a write reported failed may land afterwards. A
handle the engine cannot end within the drain time is reported ``unsafe``: its destination pages
must stay quarantined.

Example::

    engine = make_engine("nixl", "prefill-0")
    engine.register([(tensor.data_ptr(), tensor.nbytes)])
    peer = engine.connect(peer_metadata)
    handles = [engine.post(peer, descs[lo:hi], note) for lo, hi, note in sections]
    outcome = wait_all(engine, handles, deadline=time.monotonic() + 10)   # {handle: None | reason}
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from ... import env
from ...errors import KvplanError
from ..pause import Pause

__all__ = ["Capabilities", "Engine", "Handle", "TransferError", "Waiting", "drain_seconds", "is_unsafe", "wait_all", "write"]

UNSAFE = "unsafe"  # how a failure reason starts when a write into its pages may still land

log = logging.getLogger(__name__)


class TransferError(KvplanError):
    """An engine failed to move bytes (dead peer, unregistered memory, deadline)."""


@dataclass(frozen=True)
class Capabilities:
    """What an engine offers beyond posting descriptor arrays.

    Attributes:
        prepared: descriptor lists prepared once per peer, written by int32 indices
            (:meth:`Engine.prepare` and :meth:`Engine.post_prepared`).
        arrays: descriptors go to the engine as arrays, with no Python lists on the way.
        abortable: an in-flight write can be cancelled before its deadline drain ends.
        notifies: a short message goes to a connected peer on its own (:meth:`Engine.notify`),
            read there by :meth:`Engine.notifications`. Staged runs return their slot credits so
            where both sides' engines can: an engine's progress thread never sleeps, where a
            ZeroMQ hop wakes two I/O threads (about 20 against 115 us one way between two
            processes of an H200 host, trips 2 ms apart: ``benchmarks/probes/hops.py``).
        device: a post takes the plan's device descriptors as they are, for several sections at once,
            with one launch (``post_device(peer, descs, notifications, bounds, alignment, typical_bytes)``,
            one handle per section: the :mod:`.ipc` engine); or in two steps, the launch queued behind
            the plan before the host has read it (``launch_device(peer, descs, rows=..., after=...)``,
            its row count on the device), its sections' handles once the host knows them
            (``section_handles(launch, notifications, bounds)``).
    """

    prepared: bool = False
    arrays: bool = False
    abortable: bool = False
    notifies: bool = False
    device: bool = False


@dataclass(eq=False)
class Handle:
    """One posted write. ``state`` is ``"PROC"``, ``"DONE"`` or ``"ERR"``; ``error`` says why."""

    peer: str
    nbytes: int
    native: Any = None
    state: str = "PROC"
    error: str | None = None
    kept: bool = False  # the engine keeps the native handle to repost it (see Engine.post's ``reuse``)


class Engine(Protocol):
    """The interface of a transfer engine (see the module docstring)."""

    name: str
    capabilities: Capabilities

    def register(self, regions: list[tuple[int, int]]) -> None: ...

    def metadata(self) -> bytes: ...

    def connect(self, peer_metadata: bytes) -> str: ...

    def post(self, peer: str, descs: np.ndarray, notification: bytes, reuse: object = None) -> Handle:
        """Start writing ``descs``; never blocks for the bytes. A failure to post is a handle in ``ERR``.

        ``reuse``: a key under which the engine may keep the write to repost it when the same
        descriptors are posted again under that key (staging slots); engines without reposting
        ignore it."""
        ...

    def progress(self, handle: Handle) -> str:
        """Advance ``handle`` and return its state (``PROC``, ``DONE`` or ``ERR``)."""
        ...

    def abort(self, handle: Handle) -> bool:
        """Try to end an in-flight handle; True once it has ended (no more of its bytes will land), or
        once the engine knows it cannot tell: then ``handle.error`` starts with ``unsafe``."""
        ...

    def notifications(self) -> list[tuple[str | None, bytes]]:
        """What has arrived since the last call: each notification with the name of the engine that
        sent it (its ``name``; ``None`` where the engine cannot say)."""
        ...

    def notify(self, peer: str, message: bytes) -> None:
        """Send ``message`` to a connected peer on its own (engines whose capabilities say ``notifies``)."""
        ...

    def wait_fds(self) -> tuple[int, ...]:
        """File descriptors that become readable when a notification arrives, for a loop to block on
        (:func:`~kvplan.transport.runtime.loop.wait_ready`); empty where the engine offers only polls
        (NIXL, Mooncake): a loop then polls :meth:`notifications` at its cadence."""
        ...

    def stats(self) -> dict[str, int]:
        """What it holds now: ``regions`` registered, ``peers`` connected, ``handles`` kept (``kvplan load``
        watches them for growth)."""
        ...

    def disconnect(self, peer: str) -> None:
        """Forget a connected peer that is gone (what :meth:`connect` made for it, and handles kept for
        it); nothing of it may be in flight. A later :meth:`connect` to it starts over."""
        ...

    def close(self) -> None: ...


def is_unsafe(reason: object) -> bool:
    """Whether a failure reason (:func:`wait_all`'s, or a peer's report of one) says a write into the
    request's pages may still land."""
    return str(reason).startswith(UNSAFE)


def drain_seconds() -> float:
    """How long an aborted handle may take to end (``KVPLAN_DRAIN_S``, default 5 s)."""
    return env.number("KVPLAN_DRAIN_S")


class Waiting:
    """The writes of ``handles`` ending under ``deadline``, one look at a time (:meth:`step`): what
    :func:`wait_all` waits for, steppable by a loop that moves other work meanwhile. ``outcome``: per
    handle, ``None`` once it completed, else the reason (see :func:`wait_all`)."""

    def __init__(self, engine: Engine, handles: list[Handle], deadline: float,
                 give_up: Callable[[Handle], str | None] | None = None):
        self.engine, self.deadline, self.give_up = engine, deadline, give_up
        self.outcome: dict[Handle, str | None] = {}
        self.live: list[Handle] = []
        for h in handles:
            if h.state == "ERR":
                self.outcome[h] = h.error or "the engine refused the write"
            else:
                self.live.append(h)
        self.aborting: dict[Handle, tuple[str, float]] = {}  # handle -> (why, when its drain ends)

    def done(self) -> bool:
        return not self.live and not self.aborting

    def step(self) -> bool:
        """One look at every write; whether any ended."""
        engine, before = self.engine, len(self.live) + len(self.aborting)
        still = []
        for h in self.live:
            state = engine.progress(h)
            if state == "DONE":
                self.outcome[h] = None
            elif state == "ERR":
                self.outcome[h] = h.error or "the engine reported an error"
            else:
                still.append(h)
        self.live = still
        now = time.monotonic()
        if self.live and now > self.deadline:
            self.aborting.update((h, ("deadline passed", now + drain_seconds())) for h in self.live)
            self.live = []
        if self.live and self.give_up is not None:  # (a write to a dead peer is given up; the others' go on)
            going = []
            for h in self.live:
                if (lost := self.give_up(h)) is None:
                    going.append(h)
                else:
                    self.aborting[h] = (lost, now + drain_seconds())
            self.live = going
        for h, (why, drain_end) in list(self.aborting.items()):
            if engine.abort(h):
                if is_unsafe(h.error):  # ended as far as the engine can tell, which cannot say that nothing will land
                    self.outcome[h] = f"{UNSAFE}: {why}; {h.error[len(UNSAFE) + 2:]}"
                else:
                    self.outcome[h] = f"{why}; the write had ended (cancelled or completed) when this was reported"
                del self.aborting[h]
            elif time.monotonic() > drain_end:
                log.error("a write to %s could not be ended %.1f s after its abort; its destination pages must stay "
                          "quarantined", h.peer, drain_seconds())
                self.outcome[h] = (f"{UNSAFE}: {why} and the engine could not end the write; its pages may still "
                                   "be written")
                del self.aborting[h]
        return len(self.live) + len(self.aborting) < before


def wait_all(engine: Engine, handles: list[Handle], deadline: float,
             give_up: Callable[[Handle], str | None] | None = None) -> dict[Handle, str | None]:
    """Wait for every handle until ``deadline``; ``None`` per handle that completed, else the reason.

    Handles still in flight at the deadline are aborted, and so is each handle for which
    ``give_up(handle)`` returns a reason (its peer is dead), while the others go on; each is
    reported only once it has ended, or :func:`drain_seconds` after its abort as ``unsafe`` (its pages
    may still be written). Aborted writes drain together: eight stuck writes take one drain, not
    eight (measured: 40.5 s against a bound of 5.5 s when they drained one after another).
    """
    waiting = Waiting(engine, handles, deadline, give_up)
    pause = Pause()  # one slice of the poll cadence between looks (the engine's own thread moves the writes)
    while not waiting.done():
        if waiting.step():
            pause.busy()
        if not waiting.done():
            pause()
    return waiting.outcome


def write(engine: Engine, peer: str, descs: np.ndarray, notification: bytes, deadline: float) -> None:
    """Post one write and wait for it; raise :class:`TransferError` on failure (tests, benchmarks)."""
    handle = engine.post(peer, descs, notification)
    reason = wait_all(engine, [handle], deadline)[handle]
    if reason is not None:
        raise TransferError(f"write to {peer} failed: {reason}")
