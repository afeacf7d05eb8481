"""kvplan's counters as the payload of vLLM's connector stats, without vLLM (the worker makes the payload;
:mod:`.connector_stats` gives it vLLM's type): requests sent, received and failed, failures by cause, bytes
moved, and the count and sum of request times."""

from __future__ import annotations

from typing import Any

__all__ = ["COUNTS", "counted", "interval_counts"]

COUNTS = ("requests_sent", "requests_received", "requests_failed", "bytes", "latency_count")


def counted(data: dict[str, Any]) -> bool:
    """Whether a payload counts anything: a request or a byte (latencies come with requests)."""
    return any(data.get(k) for k in ("requests_sent", "requests_received", "requests_failed", "bytes"))


def interval_counts(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """The :class:`KvplanConnectorStats` payload of endpoints' :meth:`stats` snapshots (cumulative)."""
    out: dict[str, Any] = {**{k: 0 for k in COUNTS}, "latency_sum_s": 0.0, "failures": {}}
    for snap in snapshots:
        requests = snap.get("requests", {})
        out["requests_sent"] += int(requests.get("sent", 0))
        out["requests_received"] += int(requests.get("complete", 0))
        out["requests_failed"] += int(requests.get("failed", 0))
        out["bytes"] += int(snap.get("bytes", 0))
        out["latency_count"] += int(snap.get("latency_ms", {}).get("count", 0))
        out["latency_sum_s"] += float(snap.get("latency_ms", {}).get("sum_s", 0.0))
        for cause, n in snap.get("failures", {}).items():
            out["failures"][cause] = out["failures"].get(cause, 0) + int(n)
    return out
