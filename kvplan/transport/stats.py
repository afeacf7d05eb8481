"""An endpoint's counters for its operator: requests by outcome, bytes, failures by cause, latency,
requests in flight and bounds hit (:meth:`PrefillEndpoint.stats`, :meth:`DecodeEndpoint.stats`).

Counting costs a few dictionary updates per settled request (no scan of tracked requests); the
latency percentiles are computed over the last :data:`LATENCY_WINDOW` requests when asked.
:mod:`kvplan.transport.metrics` exports the same numbers in Prometheus' text format.

Example::

    stats = decode.stats()
    stats["requests"]["complete"], stats["failures"].get("deadline", 0), stats["latency_ms"]["p99"]
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from typing import Any, Sequence

import numpy as np

__all__ = ["CAUSES", "EndpointStats", "LATENCY_WINDOW", "cause_of"]

LATENCY_WINDOW = 4096  # the latest settled requests whose latencies the percentiles cover

# a failure's cause, from the words of its reason (the first that matches); the reasons are kvplan's own
_CAUSE_WORDS = (
    ("overload", "overload"),
    ("integrity", "integrity"),
    ("deadline", "deadline"),
    ("abort", "aborted"),
    ("refused", "refused"),
    ("gone", "peer gone"),
    ("could not be published", "peer gone"),
    ("never published", "peer gone"),
    ("unsafe", "unsafe"),
    ("engine", "engine"),
)
CAUSES = tuple(dict.fromkeys(cause for _, cause in _CAUSE_WORDS)) + ("other",)


def cause_of(reason: str | None) -> str:
    """The cause (one of :data:`CAUSES`) a failure's reason names."""
    text = (reason or "").lower()
    return next((cause for word, cause in _CAUSE_WORDS if word in text), "other")


class EndpointStats:
    """Counters of one endpoint. Updated where requests settle; read with :meth:`snapshot` from any
    thread (a lock held for a few dictionary updates)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._lock = threading.Lock()
        self._requests: Counter[str] = Counter()
        self._failures: Counter[str] = Counter()
        self._bounds: Counter[str] = Counter()
        self._bytes = 0
        self._latency_s: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._latency_sum = 0.0
        self._latency_count = 0

    def settled(self, outcome: str, count: int = 1, nbytes: int = 0) -> None:
        """``count`` requests ended with ``outcome`` (``complete``, ``sent``, ...), moving ``nbytes``."""
        with self._lock:
            self._requests[outcome] += count
            self._bytes += nbytes

    def failed(self, reason: str | None, count: int = 1) -> None:
        """``count`` requests failed for ``reason`` (counted under its :func:`cause_of`)."""
        with self._lock:
            self._requests["failed"] += count
            self._failures[cause_of(reason)] += count

    def latency(self, seconds: float) -> None:
        """One request's time to its end (the decode: publish to decode-ready; the prefill: send to settled)."""
        with self._lock:
            self._latency_s.append(seconds)
            self._latency_sum += seconds
            self._latency_count += 1

    def sent(self, transfers: Sequence[Any], result: dict[Any, str | None], took_s: float, nbytes: int) -> None:
        """A prefill's send in the counters: each failure, each request whose last chunk went. Its bytes
        count in full when nothing of it failed, else in the share of its requests that went (a send
        plans its bytes for the batch, not per request)."""
        for reason in result.values():
            if reason is not None:
                self.failed(reason)
        ended = {t.request for t in transfers if t.last and result.get(t.request) is None}
        failed = sum(reason is not None for reason in result.values())
        sent_share = 1.0 if not failed else (len(result) - failed) / max(len(result), 1)
        self.settled("sent", len(ended), nbytes=int(nbytes * sent_share))
        for _ in ended:
            self.latency(took_s)

    def hit(self, bound: str) -> None:
        """A bound was reached once (a wave waited for a staging slot, a publisher count was capped...)."""
        with self._lock:
            self._bounds[bound] += 1

    def totals(self) -> dict[str, Any]:
        """The cumulative counters alone (no percentiles: cheap enough for every step of an engine):
        requests by outcome, bytes, failures by cause, and the count and sum of latencies."""
        with self._lock:
            return {"requests": dict(self._requests), "bytes": self._bytes, "failures": dict(self._failures),
                    "latency_ms": {"count": self._latency_count, "sum_s": self._latency_sum}}

    def snapshot(self, in_flight: int) -> dict[str, Any]:
        """What :meth:`PrefillEndpoint.stats` and :meth:`DecodeEndpoint.stats` return."""
        with self._lock:
            window = np.fromiter(self._latency_s, float, len(self._latency_s))
            latency = {"count": self._latency_count, "sum_s": round(self._latency_sum, 6)}
            if len(window):
                latency["p50"] = round(float(np.percentile(window, 50)) * 1e3, 3)
                latency["p99"] = round(float(np.percentile(window, 99)) * 1e3, 3)
            return {"role": self.role, "requests": dict(self._requests), "bytes": self._bytes,
                    "failures": dict(self._failures), "latency_ms": latency, "in_flight": in_flight,
                    "bounds_hit": dict(self._bounds)}
