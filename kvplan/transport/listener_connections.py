"""The connections a :class:`~.listener.ChannelListener` has accepted, each ended within a bound.

A listener's connection carries one exchange: a hello, and the answer naming a channel's port (the decode
then closes it). Anything that stays is a stranger's, holding one of this process's descriptors: ZeroMQ
keeps an idle connection for ever and has no bound on how many it accepts. :class:`ConnectionBound`
watches the listening socket's accepted connections (its monitor) and ends each one older than
``max_age_s``, and beyond ``max_count`` open at once the oldest first, by shutting the connection down
through a duplicate of ZeroMQ's descriptor (ZeroMQ then sees it closed and lets it go).

A descriptor is shut down only while it still is the connection that was accepted (the listener's port
on this end, the same address at the other): one ZeroMQ has closed and the kernel has handed to another
connection since is left alone.

Example::

    bound = ConnectionBound(zmq, router, port=8998, max_count=256, max_age_s=5.0)
    bound.step(time.monotonic())     # at every accept_pending: reads the monitor, ends what is past a bound
"""

from __future__ import annotations

import os
import socket as pysocket
from collections import OrderedDict
from typing import Any

from .control_wire import monitor_numbers

__all__ = ["ConnectionBound"]


class ConnectionBound:
    """Ends a listening socket's connections older than ``max_age_s``, and the oldest beyond ``max_count``."""

    def __init__(self, zmq: Any, router: Any, port: int, max_count: int, max_age_s: float):
        from zmq.utils.monitor import recv_monitor_message

        self._zmq, self._recv, self.port = zmq, recv_monitor_message, port
        self.max_count, self.max_age_s = max_count, max_age_s
        self._router = router
        address = f"inproc://kvplan-listener-monitor-{next(monitor_numbers)}"
        # (as a channel's: the monitor's receiving end unbounded, or libzmq's one I/O thread blocks on it)
        router.monitor(address, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._monitor = zmq.Context.instance().socket(zmq.PAIR)
        self._monitor.setsockopt(zmq.RCVHWM, 0)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(address)
        self._open: OrderedDict[int, tuple[float, Any]] = OrderedDict()  # fd -> (when accepted, the other end)
        self.ended = 0  # connections this bound ended, over the listener's life

    def __len__(self) -> int:
        return len(self._open)

    def step(self, now: float) -> None:
        """Read the connections accepted and gone since the last step; end those past a bound."""
        zmq = self._zmq
        while self._monitor.poll(0):
            event = self._recv(self._monitor)
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._open.pop(fd, None)
                self._open[fd] = (now, _other_end(fd))
            else:
                self._open.pop(fd, None)
        while self._open:
            fd, (accepted, other) = next(iter(self._open.items()))
            if len(self._open) <= self.max_count and now - accepted <= self.max_age_s:
                break
            del self._open[fd]
            self._end(fd, other)

    def _end(self, fd: int, other: Any) -> None:
        connection = _duplicate(fd)
        if connection is None:
            return  # (closed by ZeroMQ meanwhile, or no socket any more)
        with connection:
            try:
                if connection.family not in (pysocket.AF_INET, pysocket.AF_INET6) or other is None \
                        or connection.getsockname()[1] != self.port or connection.getpeername() != other:
                    return  # (the descriptor is another connection's by now)
                connection.shutdown(pysocket.SHUT_RDWR)
                self.ended += 1
            except OSError:
                pass

    def close(self) -> None:
        """Stop the monitor, then close its reading end (never the other way round: see ``__del__``)."""
        try:
            self._router.disable_monitor()
        except self._zmq.ZMQError:
            pass
        self._monitor.close(0)

    def __del__(self) -> None:
        # a listener dropped unclosed: its sockets close in any order, and a listening socket that closes after
        # its monitor's reading end would leave libzmq's I/O thread waiting for ever to send it an event (every
        # socket of the process with it): the monitor is stopped first
        try:
            if not self._monitor.closed:
                self._router.disable_monitor()
        except Exception:  # noqa: BLE001 - half made, or the interpreter shutting down
            pass


def _duplicate(fd: int) -> pysocket.socket | None:
    """A socket object over a duplicate of descriptor ``fd`` (closing it leaves ``fd`` open), or ``None`` where
    ``fd`` is closed or no socket (by the time a monitor event is read, the descriptor may be another file's)."""
    try:
        copy = os.dup(fd)
    except OSError:
        return None
    try:
        return pysocket.socket(fileno=copy)
    except OSError:
        os.close(copy)
        return None


def _other_end(fd: int) -> Any:
    """The address at the other end of connection ``fd``, or ``None`` where it cannot be read."""
    connection = _duplicate(fd)
    if connection is None:
        return None
    with connection:
        try:
            return connection.getpeername()
        except OSError:
            return None
