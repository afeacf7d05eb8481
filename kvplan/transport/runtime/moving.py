"""A send in flight, as a loop drives it: :class:`Moving`, stepped until done, then its result.

A sender posts its writes and returns a :class:`Moving` instead of waiting for them, so that the
prefill's progress thread can step several batches in one loop (one turn: a look at each), and
read its channels between looks; a caller without such a loop waits for one with :func:`drive`.

Example::

    moving = sender.send(ctx, transfers, planned, pending, batch, deadline)   # posted, not waited for
    while not moving.done():
        if moving.step():
            cadence.reset()
        wait_ready(moving.channels(), fds, cadence.next())
    result = moving.result()                    # request -> None, or why it failed
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

__all__ = ["Done", "Moving", "drive", "then"]


class Moving(Protocol):
    """A send whose writes are in flight."""

    def step(self) -> bool:
        """One look at its writes, credits and deadline; whether anything moved."""
        ...

    def done(self) -> bool: ...

    def result(self) -> dict[Any, str | None]:
        """Per request, ``None`` or why it failed (once :meth:`done`)."""
        ...

    def channels(self) -> Sequence[Any]:
        """The control channels whose messages move it (a wait on them ends when one comes)."""
        ...


class Done:
    """A send that ended before it was returned (nothing in flight)."""

    def __init__(self, result: dict[Any, str | None]):
        self._result = result

    def step(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def result(self) -> dict[Any, str | None]:
        return self._result

    def channels(self) -> Sequence[Any]:
        return ()


class _Then:
    def __init__(self, moving: Moving, finish: Callable[[dict[Any, str | None]], dict[Any, str | None]]):
        self.moving, self.finish, self._result = moving, finish, None

    def step(self) -> bool:
        return self.moving.step()

    def done(self) -> bool:
        return self.moving.done()

    def result(self) -> dict[Any, str | None]:
        if self._result is None:
            self._result = self.finish(self.moving.result())
        return self._result

    def channels(self) -> Sequence[Any]:
        return self.moving.channels()


def then(moving: Moving, finish: Callable[[dict[Any, str | None]], dict[Any, str | None]]) -> Moving:
    """``moving`` whose result passes through ``finish`` once (when first read)."""
    return _Then(moving, finish)


def drive(moving: Moving, fds: Sequence[int] = ()) -> dict[Any, str | None]:
    """Step ``moving`` until done, blocking between looks on its channels and ``fds`` for one slice of the
    poll cadence (:mod:`..pause`); its result."""
    from ..pause import Pause

    pause = Pause(fds=fds)
    while not moving.done():
        if moving.step():
            pause.busy()
        if not moving.done():
            pause(moving.channels())
    return moving.result()
