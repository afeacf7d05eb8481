"""How a transport wait loop waits between two looks at its engine and channels: never a spin
once it has gone quiet (docs/failures.md §5).

A loop that waits for a write, a wave or a message looks at the engine and its control channels,
then pauses. While something arrived within the last ``KVPLAN_HOT_S`` seconds (2 ms) it only
yields the core: the next wave of a staged run or the last write of a batch is that close, and a
sleep would add its latency to every transfer. Once quiet, it blocks: on its control channels
where it has some (a message wakes it at once), else in a sleep, for a slice that doubles from
50 us to 1 ms, to 2 ms once nothing has arrived for 100 ms and to 4 ms after a second. An idle
endpoint then looks about 250 times a second, each look some tens of microseconds
(benchmarks/probes/idle_cpu.py measures it), instead of burning a core. What an engine notifies while a loop is quiet (a
notification wakes no socket) is seen within one slice.

Example::

    pause = Pause()
    while not done():
        if look():            # whether anything arrived
            pause.busy()
        pause(channels)       # yields while busy, blocks once quiet
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence
from .. import env

__all__ = ["Pause", "hot_seconds", "wait_any"]

FIRST_S = 50e-6  # the first slice once quiet
LONGEST_S = 1e-3  # the longest while something arrived within IDLE_S
IDLE = ((1.0, 4e-3), (0.1, 2e-3))  # ... and once nothing has for that long (seconds quiet, longest slice)


def hot_seconds() -> float:
    """How long a loop keeps only yielding after something arrived (``KVPLAN_HOT_S``, default 0.002)."""
    return env.number("KVPLAN_HOT_S")


def wait_any(channels: Sequence[Any], timeout: float) -> None:
    """Block up to ``timeout`` seconds, or until one of ``channels`` can be read. Below a millisecond
    (ZeroMQ's unit) it sleeps; control channels are polled together; a channel without a socket
    (tests' in-memory ones) is asked by its own ``wait_readable``."""
    channels = [c for c in channels if not getattr(c, "closed", False)]  # (closed by their owner: nothing comes)
    if timeout < 1e-3 or not channels:
        time.sleep(timeout)
        return
    sockets = [getattr(c, "socket", None) for c in channels]
    if len(channels) == 1 or any(s is None for s in sockets):
        channels[0].wait_readable(timeout)
        return
    import zmq

    if any(getattr(c, "pending", bool)() for c in channels):
        return  # (a message already read off its socket, while its channel waited to send)
    poller = zmq.Poller()
    for s in sockets:
        poller.register(s, zmq.POLLIN)
    poller.poll(round(timeout * 1000))


class Pause:
    """The pause between two looks of one wait loop (see the module docstring)."""

    def __init__(self, hot_s: float | None = None, longest_s: float = LONGEST_S):
        self.hot_s = hot_seconds() if hot_s is None else hot_s
        self.longest_s = longest_s
        self._last = time.monotonic()
        self._slice = FIRST_S
        self.blocked = 0  # pauses that blocked (not merely yielded), over its life

    def busy(self) -> None:
        """Something arrived: the next pauses only yield."""
        self._last = time.monotonic()
        self._slice = FIRST_S

    def __call__(self, channels: Sequence[Any] = ()) -> None:
        quiet = time.monotonic() - self._last
        if quiet < self.hot_s:
            os.sched_yield()
            return
        wait_any(channels, self._slice)
        longest = next((s for q, s in IDLE if quiet >= q), 0.0) if self.longest_s >= LONGEST_S else 0.0
        self._slice = min(2 * self._slice, max(self.longest_s, longest))
        self.blocked += 1
