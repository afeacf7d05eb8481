"""How a transport loop waits: one blocking wait on everything that can make progress, and a poll
cadence only for what signals nothing.

A loop of the transport (a progress thread, a sender waiting for its writes or a staged run's
credits, the decode's ``wait``) waits in one :func:`wait_ready` on:

* its control channels' sockets (a message wakes it at once);
* the file descriptors its engine signals on (the ``ipc`` engine's notification socket;
  :meth:`~kvplan.transport.engines.base.Engine.wait_fds`);
* a :class:`Wakeup` its owner writes to after it queued something (a submit, a publish, an abort);
* a timeout: the next deadline, or the :class:`Cadence` while work is in flight that signals nothing
  (NIXL's and Mooncake's transfer states and notifications, CUDA events of launched work), which
  those engines offer only as polls.

The cadence starts at :data:`FIRST_S` after the last progress and doubles to :data:`LONGEST_S`: a
write that ends, a notification that lands or a kernel that finishes is seen within 50 µs while
things move and within a millisecond once they have gone quiet, at a cost of one look (some
microseconds) a slice. Nothing here sleeps or yields in a loop: every wait blocks in ``select`` with
the GIL released, so the caller's thread and the engines' threads run meanwhile.

Example::

    wakeup, cadence = Wakeup(), Cadence()
    while not done():
        if look():                                  # whether anything moved
            cadence.reset()
        wait_ready(channels, engine_fds(engine), cadence.next() if in_flight() else IDLE_S, wakeup)
    wakeup.wake()                                   # from the owner's thread, after it queued something
"""

from __future__ import annotations

import os
import select
from typing import Any, Sequence

__all__ = ["FIRST_S", "IDLE_S", "LONGEST_S", "Cadence", "Wakeup", "channel_sockets", "engine_fds", "name_thread", "wait_ready"]

FIRST_S = 50e-6  # the first poll of signal-less work after its last progress
LONGEST_S = 1e-3  # the longest gap between two polls of signal-less work in flight
IDLE_S = 0.05  # the longest a loop blocks with nothing in flight: what wakes no descriptor (a channel's
# connection events, read at most every ControlChannel.LOOK_S; a deadline) is looked at within it


class Cadence:
    """The poll cadence of signal-less work in flight: :data:`FIRST_S` after progress (:meth:`reset`),
    doubling at each :meth:`next` up to ``longest_s``."""

    def __init__(self, first_s: float = FIRST_S, longest_s: float = LONGEST_S):
        self.first_s, self.longest_s = first_s, longest_s
        self._slice = first_s

    def reset(self) -> None:
        self._slice = self.first_s

    def next(self) -> float:
        """The timeout of this wait (and the next one's doubled)."""
        slice_s = self._slice
        self._slice = min(2 * slice_s, self.longest_s)
        return slice_s


class Wakeup:
    """A wake-up another thread writes to: an eventfd where the system has one, else a pipe. ``wake``
    from any thread; the loop it wakes passes it to :func:`wait_ready`, which clears it."""

    def __init__(self) -> None:
        if hasattr(os, "eventfd"):
            self._read = self._write = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:  # pragma: no cover - (no eventfd: not Linux)
            self._read, self._write = os.pipe()
            os.set_blocking(self._read, False)
            os.set_blocking(self._write, False)

    def fileno(self) -> int:
        return self._read

    def wake(self) -> None:
        try:
            if self._read == self._write:
                os.eventfd_write(self._write, 1)
            else:
                os.write(self._write, b"x")
        except OSError:  # (full, or closed while the owner closes: the loop is awake or gone)
            pass

    def clear(self) -> None:
        try:
            if self._read == self._write:
                os.eventfd_read(self._read)
            else:
                while os.read(self._read, 4096):
                    pass
        except OSError:  # (nothing to read)
            pass

    def close(self) -> None:
        for fd in {self._read, self._write}:
            try:
                os.close(fd)
            except OSError:
                pass


def channel_sockets(channels: Sequence[Any]) -> tuple[list[Any], bool, bool]:
    """For ``channels``: the ZeroMQ sockets to wait on (each one's ``wait_sockets()``: its message socket
    and connection monitor); whether one holds a message already read off its socket (``pending``: a
    wait must not block); whether one has no socket (tests' in-memory channels)."""
    sockets, unpollable = [], False
    for channel in channels:
        if getattr(channel, "closed", False):
            continue  # (its owner closed it: nothing comes)
        if getattr(channel, "pending", bool)():
            return [], True, unpollable
        own = getattr(channel, "wait_sockets", None)
        if own is None:
            if getattr(channel, "wait_readable", lambda _: False)(0):
                return [], True, True
            unpollable = True
        else:
            sockets.extend(own())
    return sockets, False, unpollable


def wait_ready(channels: Sequence[Any], fds: Sequence[int], timeout: float, wakeup: Wakeup | None = None) -> bool:
    """Block up to ``timeout`` seconds until one of ``channels`` can be read (or its connection changed),
    one of ``fds`` is readable, or ``wakeup`` was woken (then cleared). Whether something woke it before
    the timeout. A channel without a socket cannot be waited on: the wait is then at most 1 ms."""
    import zmq

    sockets, pending, unpollable = channel_sockets(channels)
    if pending:
        return True
    if unpollable:
        timeout = min(timeout, 1e-3)
    readers = [] if wakeup is None else [wakeup.fileno()]
    readers.extend(fds)
    for socket in sockets:
        # ZeroMQ's descriptor is edge-triggered: it says only that the socket's state may have changed, so
        # the socket is asked first; a wait on the descriptor then ends at the next change
        if socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            return True
        readers.append(socket.getsockopt(zmq.FD))
    try:
        ready, _, _ = select.select(readers, [], [], max(0.0, timeout))
    except (OSError, ValueError):  # (a descriptor closed by another thread as it closes: look again)
        return True
    if wakeup is not None and wakeup.fileno() in ready:
        wakeup.clear()
    return bool(ready)


def engine_fds(engine: Any) -> tuple[int, ...]:
    """What ``engine`` signals its notifications on (:meth:`~kvplan.transport.engines.base.Engine.wait_fds`;
    none for an engine without the method, such as tests' fakes)."""
    fds = getattr(engine, "wait_fds", None)
    return tuple(fds()) if fds is not None else ()


def name_thread(name: str) -> None:
    """Give the calling thread ``name`` (15 bytes at most) where the system shows it (``top -H``, ``ps -L``,
    ``/proc/self/task/*/comm``), so that a progress thread's CPU is told apart from its process's other
    threads; nothing where the system has no such name."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # pragma: no cover - (not Linux)
        pass
