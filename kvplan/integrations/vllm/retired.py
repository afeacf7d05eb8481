"""A decode worker's retired endpoints (:class:`RetiredEndpoints`): those whose prefill is gone (it ended,
restarted or went silent), polled until the requests published through them settle, then closed with their
engines; what they counted stays in the connector's stats.

Example::

    retired = RetiredEndpoints()
    retired.add(decode)                                      # its prefill is gone: new requests pair anew
    retired.close_unused(in_use={id(r.endpoint) for r in receiving.values()}, engines=engines)
    counts = retired.totals()                                # the open ones' counters and the closed ones'
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

from ...transport.decode import DecodeEndpoint

__all__ = ["RetiredEndpoints"]

log = logging.getLogger(__name__)


class RetiredEndpoints:
    """Retired decode endpoints still open (iterated, polled by the worker) and the counters of those closed."""

    def __init__(self) -> None:
        self.open: list[DecodeEndpoint] = []
        self.closed_totals: list[dict[str, Any]] = []

    def __iter__(self) -> Iterator[DecodeEndpoint]:
        return iter(self.open)

    def __len__(self) -> int:
        return len(self.open)

    def add(self, decode: DecodeEndpoint) -> None:
        self.open.append(decode)

    def close_unused(self, in_use: set[int], engines: list[Any]) -> None:
        """Close each endpoint whose ``id`` is not in ``in_use`` (no request receives through it): its channels
        and its engine, taken out of ``engines`` (kept from growing over restarts); its counters kept."""
        for decode in [d for d in self.open if id(d) not in in_use]:
            self.open.remove(decode)
            self.closed_totals.append(decode.totals())
            for close in [c.close for c in decode.channels] + [decode.engine.close]:
                try:
                    close()
                except Exception as err:  # noqa: BLE001 - a resource already gone: nothing left to release
                    log.warning("closing a retired decode endpoint: %s: %s", type(err).__name__, err)
            if decode.engine in engines:
                engines.remove(decode.engine)

    def totals(self) -> list[dict[str, Any]]:
        """Every retired endpoint's counters: the open ones' now, the closed ones' as they were at the close."""
        return [d.totals() for d in self.open] + self.closed_totals
