"""How a transport wait loop waits between two looks at its engine and channels: it blocks, never
spins (docs/failures.md §5).

A loop that waits for a write, a wave or a message looks at the engine and its control channels,
then pauses: it blocks in one :func:`~.runtime.loop.wait_ready` on its control sockets (a message
wakes it at once) and its engine's descriptors where the engine has some, for a slice of the poll
cadence (:class:`~.runtime.loop.Cadence`): 50 µs after something arrived, doubling to 1 ms while
nothing does. What signals nothing (NIXL's and Mooncake's transfer states and notifications, a
CUDA event) is thus seen within 50 µs while things move and within 1 ms once quiet, each look some
microseconds, with the GIL released between looks (the caller's thread and the engine's threads run).

Example::

    pause = Pause()
    while not done():
        if look():            # whether anything arrived
            pause.busy()
        pause(channels)       # blocks on the channels for one slice of the cadence
"""

from __future__ import annotations

from typing import Any, Sequence

from .runtime.loop import LONGEST_S, Cadence, Wakeup, wait_ready

__all__ = ["Pause"]


class Pause:
    """The pause between two looks of one wait loop (see the module docstring)."""

    def __init__(self, longest_s: float = LONGEST_S, fds: Sequence[int] = ()):
        self.cadence = Cadence(longest_s=longest_s)
        self.fds = tuple(fds)
        self.blocked = 0  # pauses over its life

    def busy(self) -> None:
        """Something arrived: the next pause is the cadence's shortest."""
        self.cadence.reset()

    def __call__(self, channels: Sequence[Any] = (), wakeup: Wakeup | None = None) -> None:
        """Block one slice, or until a channel, a descriptor of :attr:`fds` or ``wakeup`` wakes it."""
        wait_ready(channels, self.fds, self.cadence.next(), wakeup)
        self.blocked += 1
