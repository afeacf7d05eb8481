"""kvplan's counters as vLLM's connector stats (``get_kv_connector_stats``): what each worker's endpoints
counted since the worker's last report, summed over vLLM's workers by :meth:`KvplanConnectorStats.aggregate`
and reduced to one line of vLLM's periodic log by :meth:`KvplanConnectorStats.reduce`.

The payload is plain numbers (vLLM sends it from the worker to its logger process): requests sent,
received and failed, failures by cause (:data:`kvplan.transport.stats.CAUSES`), bytes moved, and the
sum and count of request times (the prefill's from send to settled, the decode's from publication to
decode-ready).

Example::

    stats = KvplanConnectorStats(data=worker.interval_stats())
    stats.aggregate(other_worker_stats).reduce()["Requests sent"]
"""

from __future__ import annotations


from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .counters import COUNTS, counted

__all__ = ["KvplanConnectorStats"]


class KvplanConnectorStats(KVConnectorStats):
    """Counters of one reporting interval (see the module docstring)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {**{k: 0 for k in COUNTS}, "latency_sum_s": 0.0, "failures": {}}

    def is_empty(self) -> bool:
        return not counted(self.data)

    def aggregate(self, other: KVConnectorStats) -> KvplanConnectorStats:
        if other.is_empty():
            return self
        for k in COUNTS:
            self.data[k] = self.data.get(k, 0) + int(other.data.get(k, 0))
        self.data["latency_sum_s"] = self.data.get("latency_sum_s", 0.0) + float(other.data.get("latency_sum_s", 0.0))
        failures = dict(self.data.get("failures", {}))
        for cause, n in other.data.get("failures", {}).items():
            failures[cause] = failures.get(cause, 0) + int(n)
        self.data["failures"] = failures
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        count = int(d.get("latency_count", 0))
        out: dict[str, int | float] = {
            "Requests sent": int(d.get("requests_sent", 0)),
            "Requests received": int(d.get("requests_received", 0)),
            "Requests failed": int(d.get("requests_failed", 0)),
            "MiB moved": round(int(d.get("bytes", 0)) / (1 << 20), 3),
            "Avg request time (ms)": round(float(d.get("latency_sum_s", 0.0)) / count * 1e3, 3) if count else 0.0,
        }
        for cause, n in sorted(d.get("failures", {}).items()):
            out[f"Failed ({cause})"] = int(n)
        return out
