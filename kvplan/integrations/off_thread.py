"""One blocking call run off an engine's scheduler thread (:class:`OffThread`): a bootstrap lookup, a
control connection and its handshake, an endpoint made and paired. The scheduler's thread starts it and
later reads how it ended; it never waits for it.
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

from ..errors import KvplanError

__all__ = ["OffThread"]

T = TypeVar("T")


class OffThread(Generic[T]):
    """``call()`` run on a thread of its own. Every wait inside it has its own deadline, so the thread
    ends; :meth:`join` bounds the wait of a caller that closes.

    Example::

        lookup = OffThread(lambda: prefill_layout(host, port, timeout=5), "kvplan-bootstrap")
        ...                                   # the scheduler's next steps
        if lookup.done():
            layout = lookup.value             # or lookup.reason() when it raised
    """

    def __init__(self, call: Callable[[], T], name: str):
        self.value: T | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(call,), name=name, daemon=True)
        self._thread.start()

    def _run(self, call: Callable[[], T]) -> None:
        try:
            self.value = call()
        except Exception as err:  # noqa: BLE001 - whoever reads it fails its requests with the reason
            self.error = err

    def done(self) -> bool:
        """Whether the call has ended (with :attr:`value`, or :attr:`error`)."""
        return not self._thread.is_alive()

    def reason(self) -> str:
        """Why the call failed, as a request's failure names it (a kvplan error's own words)."""
        err = self.error
        return str(err) if isinstance(err, KvplanError) else f"{type(err).__name__}: {err}"

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the call to end; whether it has."""
        self._thread.join(timeout)
        return self.done()
