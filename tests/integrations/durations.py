"""What the two-process harnesses report of a list of durations (their nodes print it in their JSON line)."""

from __future__ import annotations

import numpy as np


def step_stats(steps: list[float]) -> dict:
    """Count, p50, p99, max and total (ms) of durations in seconds: what a rank's scheduler or engine spent per
    step in the connector's or the queues' calls, or the requests' times to ready."""
    ms = np.array(steps or [0.0]) * 1e3
    return {"count": len(steps), "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "max_ms": float(ms.max()), "total_ms": float(ms.sum())}
