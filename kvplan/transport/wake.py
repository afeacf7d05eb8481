"""How a progress thread waits: on its control channels' sockets and on a pipe its owner writes to, so
that a message or a call of the owner wakes it at once and nothing else costs a look before its slice
has passed (:mod:`.progress_thread`, :mod:`.decode_thread`).

Example::

    wakeup = WakePipe()
    wakeup.wait(channels, 0.02)    # on the thread: until a channel can be read, wake() or 20 ms
    wakeup.wake()                  # from the owner's thread, after it queued something
"""

from __future__ import annotations

import os
from typing import Any, Sequence

__all__ = ["WakePipe"]


class WakePipe:
    """A non-blocking pipe: :meth:`wake` from any thread, :meth:`wait` on the thread it wakes."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def wake(self) -> None:
        try:
            os.write(self._write, b"x")
        except (BlockingIOError, OSError):  # (the pipe is full: the thread is woken already)
            pass

    def wait(self, channels: Sequence[Any], timeout: float) -> None:
        """Block up to ``timeout`` seconds (at least ZeroMQ's millisecond) until one of ``channels`` can be
        read or :meth:`wake` was called. A channel without a socket (tests' in-memory ones) cannot be
        polled: the wait is then at most 1 ms."""
        import zmq

        if any(getattr(channel, "pending", bool)() for channel in channels):
            return  # (a message already read off its socket, while its channel waited to send)
        poller = zmq.Poller()
        poller.register(self._read, zmq.POLLIN)
        for channel in channels:
            if getattr(channel, "closed", False):
                continue  # (its owner closed it: nothing comes)
            socket = getattr(channel, "socket", None)
            if socket is not None:
                poller.register(socket, zmq.POLLIN)
            else:
                timeout = min(timeout, 1e-3)
        if self._read in dict(poller.poll(max(1, round(timeout * 1000)))):
            try:
                while os.read(self._read, 4096):
                    pass
            except (BlockingIOError, OSError):
                pass

    def close(self) -> None:
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
