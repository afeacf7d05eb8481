"""A submitted batch (:meth:`PrefillEndpoint.submit`): the caller's view of work that goes on in the
endpoint's progress thread.

A handle is written once, by the progress thread, when its batch has ended (every write ended and
settled, or the batch refused); the caller reads it whenever it likes. ``result()`` is the one call
that waits, and only when asked to.

Example::

    handle = prefill.submit(transfers, mode="staged", timeout=30)
    ...                                   # the scheduler goes on
    if handle.done():
        failures = {r: why for r, why in handle.result().items() if why}
"""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

__all__ = ["SendHandle"]


class SendHandle:
    """One submitted batch: its requests, and once it has ended, per request ``None`` (sent) or the
    reason it failed, as :meth:`PrefillEndpoint.send` returns them."""

    def __init__(self, requests: Sequence[Any]):
        self.requests = tuple(dict.fromkeys(requests))
        self.submitted = time.monotonic()
        self.ended: float | None = None  # time.monotonic() when it ended
        self._event = threading.Event()
        self._result: dict[Any, str | None] | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the batch has ended (never waits)."""
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> dict[Any, str | None]:
        """The batch's outcome per request, waiting up to ``timeout`` seconds (``None``: until it ends;
        the batch's own deadline bounds that). Raises ``TimeoutError`` when it has not ended by then,
        and the batch's :class:`~kvplan.errors.PlanError` when it did not plan (nothing of it was sent)."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"the batch of {len(self.requests)} requests has not ended within {timeout} s")
        if self._error is not None:
            raise self._error
        return dict(self._result or {})

    def _finish(self, result: dict[Any, str | None] | None = None, error: BaseException | None = None) -> None:
        """(The progress thread) the batch has ended."""
        self._result, self._error = result, error
        self.ended = time.monotonic()
        self._event.set()

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"SendHandle({len(self.requests)} requests, {state})"
