"""The endpoints' counters (:mod:`.stats`) in Prometheus' text format, through ``prometheus-client``
(the ``prometheus`` extra: ``pip install '.[prometheus]'``).

:func:`collector` turns a source of :meth:`~.stats.EndpointStats.snapshot` dictionaries (one per
endpoint, each with an ``endpoint`` name) into a collector for a registry; :func:`serve` serves one on
an address the caller chooses; :func:`render` gives the text a scrape would return.

=================================== ======= ================================================
metric                              type    labels (besides ``role`` and ``endpoint``)
=================================== ======= ================================================
``kvplan_requests_total``           counter ``outcome``: complete, sent, failed
``kvplan_failures_total``           counter ``cause``: :data:`~.stats.CAUSES`
``kvplan_bytes_total``              counter
``kvplan_in_flight``                gauge
``kvplan_bounds_hit_total``         counter ``bound``
``kvplan_latency_seconds``          summary count and sum of every request's latency
``kvplan_latency_seconds_quantile`` gauge   ``quantile``: 0.5, 0.99 (over the latest requests)
``kvplan_open_channels_total``      counter none: the process's control channels run open (no secret, by
                                            the explicit opt-out ``KVPLAN_INSECURE``; docs/failures.md §10)
=================================== ======= ================================================

Example::

    server = serve(lambda: [{**decode.stats(), "endpoint": "decode-0"}], host, 9400)
    ...
    server.close()
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from . import auth

__all__ = ["MetricsServer", "collector", "render", "serve"]

Source = Callable[[], Iterable[dict[str, Any]]]


def _prometheus():
    try:
        import prometheus_client  # noqa: F401
        from prometheus_client import core
    except ImportError as err:
        raise ImportError("kvplan's metrics need prometheus-client: install kvplan's extra prometheus "
                          "(pip install '.[prometheus]' in kvplan's checkout)") from err
    return core


def collector(source: Source) -> Any:
    """A ``prometheus_client`` collector of ``source()``'s snapshots, read at every scrape."""
    core = _prometheus()

    class _Collector:
        def collect(self):
            snaps = list(source())
            base = ["role", "endpoint"]
            families = {
                "requests": core.CounterMetricFamily("kvplan_requests", "requests ended, by outcome", labels=base + ["outcome"]),
                "failures": core.CounterMetricFamily("kvplan_failures", "failed requests, by cause", labels=base + ["cause"]),
                "bytes": core.CounterMetricFamily("kvplan_bytes", "bytes of the requests that ended (decode: completed; "
                                                  "prefill: sent)", labels=base),
                "in_flight": core.GaugeMetricFamily("kvplan_in_flight", "requests tracked and not yet ended", labels=base),
                "bounds": core.CounterMetricFamily("kvplan_bounds_hit", "times a bound was reached", labels=base + ["bound"]),
                "latency": core.SummaryMetricFamily("kvplan_latency_seconds", "decode: publish to decode-ready; prefill: "
                                                    "the send that ended a request", labels=base),
            }
            quantiles = core.GaugeMetricFamily("kvplan_latency_seconds_quantile", "latency quantiles over the latest "
                                               "requests", labels=base + ["quantile"])
            for snap in snaps:
                who = [str(snap.get("role", "")), str(snap.get("endpoint", ""))]
                for outcome, count in snap["requests"].items():
                    families["requests"].add_metric(who + [outcome], count)
                for cause, count in snap["failures"].items():
                    families["failures"].add_metric(who + [cause], count)
                families["bytes"].add_metric(who, snap["bytes"])
                families["in_flight"].add_metric(who, snap["in_flight"])
                for bound, count in snap["bounds_hit"].items():
                    families["bounds"].add_metric(who + [bound], count)
                latency = snap["latency_ms"]
                families["latency"].add_metric(who, count_value=latency["count"], sum_value=latency["sum_s"])
                for key, q in (("p50", "0.5"), ("p99", "0.99")):
                    if key in latency:
                        quantiles.add_metric(who + [q], latency[key] / 1e3)
            yield from families.values()
            yield quantiles
            opened = core.CounterMetricFamily("kvplan_open_channels", "control channels this process ran without a "
                                              "secret (KVPLAN_INSECURE or an integration's insecure setting)")
            opened.add_metric([], auth.open_channels())
            yield opened

    return _Collector()


def render(source: Source) -> str:
    """The text a scrape of ``source`` returns now."""
    _prometheus()
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector(source))
    return generate_latest(registry).decode()


class MetricsServer:
    """An HTTP server of :func:`collector` (``prometheus_client``'s, on a thread of its own)."""

    def __init__(self, source: Source, host: str, port: int):
        _prometheus()
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector(source))
        self.server, self.thread = start_http_server(port, addr=host, registry=registry)
        self.host, self.port = host, self.server.server_port

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def serve(source: Source, host: str, port: int) -> MetricsServer:
    """Serve ``source``'s counters on ``host:port`` (port 0: a free one, in ``.port``) until ``close()``."""
    return MetricsServer(source, host, port)
