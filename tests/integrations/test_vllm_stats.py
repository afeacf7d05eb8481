"""kvplan's counters as vLLM's connector stats: summed over workers and intervals, reduced to vLLM's log
line, empty when nothing was counted (a real hand-off's stats: tests/integrations/test_vllm_transfer.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def _payload(sent=0, received=0, failed=0, nbytes=0, latencies=(), failures=None):
    return {"requests_sent": sent, "requests_received": received, "requests_failed": failed, "bytes": nbytes,
            "latency_count": len(latencies), "latency_sum_s": float(sum(latencies)), "failures": failures or {}}


def test_stats_of_two_workers_add_up_and_reduce_to_vllm_s_log_line():
    from kvplan.integrations.vllm.connector import KvplanConnector

    a = KvplanConnector.build_kv_connector_stats(_payload(sent=3, nbytes=3 << 20, latencies=(0.002, 0.004)))
    b = KvplanConnector.build_kv_connector_stats(_payload(received=2, failed=1, nbytes=1 << 20, latencies=(0.006,),
                                                          failures={"deadline": 1}))
    c = KvplanConnector.build_kv_connector_stats(_payload(failed=2, failures={"deadline": 1, "peer gone": 1}))
    total = a.aggregate(b).aggregate(c).reduce()
    assert total == {"Requests sent": 3, "Requests received": 2, "Requests failed": 3, "MiB moved": 4.0,
                     "Avg request time (ms)": 4.0, "Failed (deadline)": 2, "Failed (peer gone)": 1}


def test_an_interval_with_nothing_counted_is_empty_and_adds_nothing():
    from kvplan.integrations.vllm.connector import KvplanConnector

    empty = KvplanConnector.build_kv_connector_stats(None)
    assert empty.is_empty() and empty.reduce()["Requests sent"] == 0
    some = KvplanConnector.build_kv_connector_stats(_payload(failed=1, failures={"overload": 1}))
    assert not some.is_empty()  # (an interval of failures alone is reported)
    assert some.aggregate(empty).reduce()["Failed (overload)"] == 1


def test_a_worker_reports_what_its_endpoints_counted_since_its_last_report():
    from kvplan.integrations.vllm.counters import interval_counts
    from kvplan.integrations.vllm.decode_pairing import PrefillLinks
    from kvplan.integrations.vllm.worker import ConnectorWorker

    class Endpoint:
        def __init__(self):
            self.counts = {"requests": {}, "bytes": 0, "failures": {}, "latency_ms": {"count": 0, "sum_s": 0.0}}

        def totals(self):
            return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.counts.items()}

    worker = ConnectorWorker.__new__(ConnectorWorker)  # (only what interval_stats reads)
    endpoint = Endpoint()
    worker.sends, worker.prefill, worker._reported = False, None, None
    worker.links = PrefillLinks(make=None, release=None, settings=None, tp_rank=0)
    worker.links.decodes = {"d": endpoint}
    assert worker.interval_stats() is None
    endpoint.counts.update(requests={"complete": 2, "failed": 1}, bytes=100, failures={"deadline": 1},
                           latency_ms={"count": 2, "sum_s": 0.5})
    first = worker.interval_stats()
    assert first == {**interval_counts([endpoint.totals()])}
    assert worker.interval_stats() is None  # nothing new since
    endpoint.counts.update(requests={"complete": 3, "failed": 1}, bytes=160, latency_ms={"count": 3, "sum_s": 0.75})
    assert worker.interval_stats() == {"requests_sent": 0, "requests_received": 1, "requests_failed": 0,
                                       "bytes": 60, "latency_count": 1, "latency_sum_s": 0.25, "failures": {}}
    # its prefill gone, the endpoint is retired, then closed: what it counted stays counted (nothing goes negative)
    worker.links.decodes = {}
    worker.links.retired.add(endpoint)
    assert worker.interval_stats() is None
    worker.links.retired.open, worker.links.retired.closed_totals = [], [endpoint.totals()]
    assert worker.interval_stats() is None
