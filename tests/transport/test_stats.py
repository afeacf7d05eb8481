"""The endpoints' counters (kvplan.transport.stats) and their Prometheus export: each request's end
counted once, under its cause; in flight kept without scans; the text a scrape returns."""

from __future__ import annotations

import urllib.request

import pytest

from kvplan.planner.device.destinations import Expectation
from kvplan.planner.contract.plan import KV_ROLE
from kvplan.transport.completion import CompletionTracker, SectionNote
from kvplan.transport.stats import CAUSES, EndpointStats, cause_of


@pytest.mark.parametrize("reason, cause", [
    ("deadline passed before every section arrived", "deadline"),
    ("the decode side's deadline passed before every section arrived", "deadline"),
    ("load: an abort on the schedule", "aborted"),
    ("the prefill side is gone: its control connection was lost", "peer gone"),
    ("its destination lists could not be published to sender 0: timed out", "peer gone"),
    ("batch refused: AlignmentError: ...", "refused"),
    ("integrity: the bytes that landed differ from those sent", "integrity"),
    ("overload: the admission queue is full", "overload"),
    ("something else", "other"),
    (None, "other"),
])
def test_a_reason_is_counted_under_the_cause_it_names(reason, cause):
    assert cause_of(reason) == cause and cause in CAUSES


def _tracker() -> CompletionTracker:
    return CompletionTracker(None, EndpointStats("decode"))


def test_a_request_s_end_is_counted_once_with_its_bytes_and_latency():
    tracker = _tracker()
    tracker.expect(Expectation("r1", kv_pages=2, aux=False, components=()), deadline=1e18, nbytes=4096)
    tracker.expect(Expectation("r2", kv_pages=1, aux=False, components=()), deadline=1e18, nbytes=100)
    assert tracker.stats.snapshot(tracker.in_flight)["in_flight"] == 2
    tracker.on_section(SectionNote("r1", KV_ROLE, "kv", 2))
    tracker.on_section(SectionNote("r1", KV_ROLE, "kv", 0))  # another note of a completed request: no second count
    tracker.fail("r1", "deadline passed")  # (a complete request does not fail)
    tracker.fail("r2", "deadline passed before every section arrived")
    tracker.fail("r2", "the prefill side is gone")  # (failed once)
    snap = tracker.stats.snapshot(tracker.in_flight)
    assert snap["requests"] == {"complete": 1, "failed": 1} and snap["bytes"] == 4096
    assert snap["failures"] == {"deadline": 1} and snap["in_flight"] == 0
    assert snap["latency_ms"]["count"] == 1 and snap["latency_ms"]["p50"] >= 0


def test_a_request_forgotten_in_flight_leaves_no_count_and_is_no_longer_in_flight():
    tracker = _tracker()
    tracker.expect(Expectation("r1", kv_pages=2, aux=False, components=()), deadline=1e18)
    tracker.expect(Expectation("r1", kv_pages=2, aux=False, components=()), deadline=1e18)  # published again
    assert tracker.in_flight == 1
    tracker.forget("r1")
    snap = tracker.stats.snapshot(tracker.in_flight)
    assert snap["in_flight"] == 0 and snap["requests"] == {}


def test_a_request_with_nothing_to_land_completes_at_once():
    tracker = _tracker()
    tracker.expect(Expectation("r1", kv_pages=0, aux=False, components=()), deadline=1e18)
    assert tracker.state("r1") == "complete" and tracker.stats.snapshot(tracker.in_flight)["requests"] == {"complete": 1}


def _source():
    stats = EndpointStats("decode")
    stats.settled("complete", nbytes=1000)
    stats.latency(0.002)
    stats.failed("deadline passed")
    stats.hit("staging_slots")
    return [{**stats.snapshot(in_flight=3), "endpoint": "decode 0"}]


def test_the_counters_in_prometheus_text_format():
    pytest.importorskip("prometheus_client")
    from kvplan.transport.metrics import render

    text = render(_source)
    for line in ('kvplan_requests_total{endpoint="decode 0",outcome="complete",role="decode"} 1.0',
                 'kvplan_failures_total{cause="deadline",endpoint="decode 0",role="decode"} 1.0',
                 'kvplan_bytes_total{endpoint="decode 0",role="decode"} 1000.0',
                 'kvplan_in_flight{endpoint="decode 0",role="decode"} 3.0',
                 'kvplan_bounds_hit_total{bound="staging_slots",endpoint="decode 0",role="decode"} 1.0',
                 'kvplan_latency_seconds_count{endpoint="decode 0",role="decode"} 1.0',
                 'kvplan_latency_seconds_quantile{endpoint="decode 0",quantile="0.99",role="decode"} 0.002'):
        assert line in text, text


def test_a_scrape_of_the_served_counters():
    pytest.importorskip("prometheus_client")
    from kvplan.transport.metrics import serve

    server = serve(_source, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    finally:
        server.close()
    assert 'kvplan_requests_total{endpoint="decode 0",outcome="failed",role="decode"} 1.0' in text
