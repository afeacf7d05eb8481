"""``kvplan load``: serving-shaped load through real endpoints, with faults on a schedule.

One prefill process sends to ``decodes`` decode processes (fan-out), each its own process with its
own engine and control channel. Requests arrive at ``rate`` a second for ``duration`` seconds
(Poisson), with prompt lengths from a log-normal distribution, a decode-side cached prefix for a
share of them, and chunked prefill: a stand-in forward pass writes each chunk's KV (a known byte
per token, layer and request) at the chunk's ready time, and the prefill sends every chunk that
is ready in one batch. Each decode allocates pages and a row per request from free lists, publishes
them, checks every byte of a completed request, and releases its pages, a failed request's only
once :meth:`~kvplan.transport.decode.DecodeEndpoint.fenced`. Faults cycle over the requests
(``fault_every``): the decode aborts the request mid-transfer, or gives it a deadline it cannot
meet; ``kill_at`` kills the last decode process mid-run, and the other decodes' requests go on.

Reported: throughput, latency from a request's last chunk being ready to the decode seeing it
complete (p50, p99; one host's monotonic clock), failures by cause, and per process over time: RSS,
open file descriptors and sockets, the engine's registered regions, peers and kept handles, GPU
memory, and the endpoints' per-request tables (``footprint``), which must come back to empty.

Example::

    report = run_load(LoadConfig(rate=10, duration=3, decodes=2, device="cpu"))
    assert report.ok, report.problems
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..transport.stats import cause_of
from .target_process import child_message, child_pipe, start_child
from .load_config import Arrival, LoadConfig, schedule
from .load_roles import decode_process, prefill_process

__all__ = ["Arrival", "LoadConfig", "LoadReport", "run_load", "schedule"]

log = logging.getLogger(__name__)


@dataclass
class LoadReport:
    """What a load run measured (see the module docstring)."""

    config: LoadConfig
    requests: int = 0
    completed: int = 0
    verified: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # by cause
    unexpected: dict[str, int] = field(default_factory=dict)  # failures that no injected fault explains, by cause
    faults: dict[str, int] = field(default_factory=dict)  # injected, by kind
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)  # per process, its endpoint's counters at the end
    latency_ms: dict[str, float] = field(default_factory=dict)  # p50, p99: last chunk ready -> decode complete
    phases_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # where a completed request's time went (PHASES)
    throughput: dict[str, float] = field(default_factory=dict)
    quarantined: int = 0
    unsettled: int = 0
    with_killed_decode: int = 0  # requests of the decode killed mid-run (their outcome died with it)
    resources: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # per process, samples over time
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def caller_us_per_request(self) -> dict[str, float]:
        """Per process, the microseconds its caller's thread spent inside kvplan's calls, per request it
        handled (the prefill: every request it sent or failed; a decode: every request that ended there)."""
        out = {}
        for who, snap in self.stats.items():
            handled = sum(snap["requests"].values())
            if "caller_s" in snap and handled:
                out[who] = round(snap["caller_s"] / handled * 1e6, 1)
        return out

    def cpu_per_request(self) -> dict[str, dict[str, float]]:
        """Per process, the CPU milliseconds of all its threads per request it handled, and the share of one
        core it kept busy over its run (``busy``: CPU seconds over wall seconds; far below 1 with requests
        waiting is a process that sleeps instead of working)."""
        out = {}
        for who, snap in self.stats.items():
            handled = sum(snap["requests"].values())
            if "cpu_s" in snap and handled and snap.get("wall_s"):
                out[who] = {"ms": round(snap["cpu_s"] / handled * 1e3, 3), "busy": round(snap["cpu_s"] / snap["wall_s"], 3)}
        return out

    def busiest_threads(self, count: int = 4) -> dict[str, list[tuple[str, float]]]:
        """Per process, its ``count`` busiest thread names and the share of a core each kept busy."""
        out = {}
        for who, snap in self.stats.items():
            if snap.get("threads") and snap.get("wall_s"):
                top = sorted(snap["threads"].items(), key=lambda item: -item[1])[:count]
                out[who] = [(name, seconds / snap["wall_s"]) for name, seconds in top]
        return out

    def tool_turns(self) -> dict[str, dict[str, float]]:
        """Per process, the load tool's own loop: how long a turn's work took (p50, p99, max ms; its wait for
        the next event left out) and the share of the run it worked (``busy``). A turn long against a batch's
        life is the tool holding requests, not kvplan."""
        out = {}
        for who, snap in self.stats.items():
            turns = snap.get("turns")
            if turns and turns["count"] and snap.get("wall_s"):
                out[who] = {**turns, "busy": turns["busy_s"] / snap["wall_s"]}
        return out

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["config"] = asdict(self.config)
        out["caller_us_per_request"] = self.caller_us_per_request()
        out["cpu_per_request"] = self.cpu_per_request()
        return out

    def lines(self) -> list[str]:
        c = self.config
        failed = sum(self.failures.values())
        unexpected = sum(self.unexpected.values())
        refused = self.failures.get("overload", 0)
        injected = {k: v for k, v in self.failures.items() if k != "overload"}
        for cause, count in self.unexpected.items():
            injected[cause] -= count
        parts = ([f"{refused} refused at admission as overload (nothing written)"] if refused else []) \
            + ([f"{sum(injected.values())} injected ({_counts({k: v for k, v in injected.items() if v})})"]
               if sum(injected.values()) else []) \
            + ([f"{unexpected} NOT injected ({_counts(self.unexpected)})"] if unexpected else [])
        failures = f"{failed}: " + "; ".join(parts) if failed else "none"
        cpu = c.resolved_device() == "cpu"
        out = [f"load          {self.requests} requests at {c.rate:g}/s for {c.duration:g} s, {c.decodes} decodes, "
               f"{c.engine}, mode {c.mode}, {c.resolved_device()}",
               f"completed     {self.completed} ({self.verified} byte-equal)"
               + (f"; {self.with_killed_decode} went to the decode killed mid-run" if self.with_killed_decode else ""),
               "injected      " + (_counts(self.faults) + " (faults on the schedule: each must fail its request)"
                                   if self.faults else "no faults"),
               f"failed        {failures}",
               f"throughput    {self.throughput.get('requests_per_s', 0):.1f} requests/s completed over "
               f"{self.throughput.get('span_s', 0):.1f} s (offered {self.throughput.get('offered_per_s', 0):.1f}/s), "
               f"{self.throughput.get('gib_per_s', 0):.3f} GiB/s"
               + (" (CPU, Triton interpreter: not a speed measurement)" if cpu else ""),
               f"latency       p50 {self.latency_ms.get('p50', float('nan')):.2f} ms, "
               f"p99 {self.latency_ms.get('p99', float('nan')):.2f} ms (last chunk ready -> decode complete)"]
        if self.phases_ms:
            out.append("phases        " + ", ".join(f"{name} p50 {v['p50']:.1f} p99 {v['p99']:.1f} ms"
                                                    for name, v in self.phases_ms.items()))
        caller = self.caller_us_per_request()
        if caller:
            order = sorted(caller.items(), key=lambda item: (item[0] != "prefill", item[0]))
            out.append("caller thread " + ", ".join(f"{who} {us:,.0f} us" for who, us in order)
                       + " per request (inside kvplan's calls" + (", the send's wait included" if "prefill" in caller
                                                                   else "") + ")")
        process_cpu = self.cpu_per_request()
        if process_cpu:
            order = sorted(process_cpu.items(), key=lambda item: (item[0] != "prefill", item[0]))
            out.append("process CPU   " + ", ".join(f"{who} {v['ms']:.2f} ms ({v['busy']:.0%} of a core)" for who, v in order)
                       + " per request handled (every thread of the process)")
        threads = self.busiest_threads()
        if threads:
            out.append("threads CPU   " + "; ".join(f"{who}: " + ", ".join(f"{name} {share:.0%}" for name, share in top)
                                                    for who, top in sorted(threads.items(),
                                                                           key=lambda item: (item[0] != "prefill", item[0])))
                       + " of a core (each process's busiest threads, by name)")
        turns = self.tool_turns()
        if turns:
            out.append("tool turns    " + ", ".join(
                f"{who} p50 {t['p50_ms']:.2f} p99 {t['p99_ms']:.2f} max {t['max_ms']:.1f} ms ({t['busy']:.0%} of the run)"
                for who, t in sorted(turns.items(), key=lambda item: (item[0] != "prefill", item[0])))
                       + " (the load tool's own loop: a turn's work, its wait left out)")
        for who, samples in self.resources.items():
            if samples:
                a, b = samples[min(1, len(samples) - 1)], samples[-1]
                out.append(f"{who:<13} rss {a['rss_kib'] >> 10}->{b['rss_kib'] >> 10} MiB, fds {a['fds']}->{b['fds']}, "
                           f"sockets {a['sockets']}->{b['sockets']}, engine regions {a.get('engine_regions')}->"
                           f"{b.get('engine_regions')}, handles {a.get('engine_handles')}->{b.get('engine_handles')}")
        out.append("result        " + ("OK" if self.ok else "PROBLEMS: " + "; ".join(self.problems)))
        return out


PHASES = {  # a completed request's life, each phase (start, end) on the host's one monotonic clock
    "published->taken": ("published", "taken"),  # the decode's publish until the prefill had its lists and a row
    "taken->last submitted": ("taken", "submitted"),  # its earlier chunks' batches, and waits for a batch slot
    "last submitted->sent": ("submitted", "ended"),  # its last chunk's batch, submit to the prefill reading it ended
    "last submitted->complete": ("submitted", "at"),  # ... to the decode's poll returning it complete
}


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


# the load report's names for kvplan's causes of failure (kvplan.transport.stats.cause_of)
_CAUSE_NAMES = {"aborted": "abort", "peer gone": "decode gone"}


def _cause(reason: str) -> str:
    cause = cause_of(reason)
    return _CAUSE_NAMES.get(cause, cause)


def run_load(config: LoadConfig, progress: bool = False, metrics_port: int | None = None) -> LoadReport:
    """Run the processes to the end and report; problems (a byte that differs, a failure that was not
    injected, a table that did not drain, growth) are listed in ``problems``.

    ``progress``: a line on standard error, refreshed as the decodes report. ``metrics_port``: serve
    every endpoint's counters (:meth:`~kvplan.transport.decode.DecodeEndpoint.stats`) in Prometheus'
    text format on ``config.host`` at that port while the run lasts (:mod:`kvplan.transport.metrics`)."""
    if config.kill_at and config.decodes < 2:
        raise ValueError("kill_at needs at least two decodes: the killed one's peers must go on")
    if config.chunk_tokens % config.page_size or config.chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be a positive multiple of the page size {config.page_size}")
    wait = config.duration + config.timeout + 120
    procs: list[tuple[Any, Any, str]] = []  # (process, pipe, who)
    try:
        for k in range(config.decodes):
            mine, there = child_pipe()
            procs.append((start_child(decode_process, config, k, there), mine, f"decode {k}"))
        ports = [child_message(conn, who, wait)[1] for _, conn, who in procs]
        mine, there = child_pipe()
        procs.append((start_child(prefill_process, config, ports, there), mine, "prefill"))
        for _, conn, who in procs:
            child_message(conn, who, wait)  # ready: registered and paired
        started = time.monotonic() + 0.1
        for _, conn, _ in procs:
            conn.send(("go", started))
        return _collect(config, procs, started, wait, _Live(config, progress, metrics_port))
    finally:
        for proc, conn, _ in procs:
            try:
                conn.send("bye")
            except (BrokenPipeError, OSError):
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


class _Live:
    """What the processes report while the run goes: each endpoint's latest counters, shown as a
    progress line and served as metrics where asked."""

    def __init__(self, config: LoadConfig, progress: bool, metrics_port: int | None):
        self.config, self.progress = config, progress
        self.stats: dict[str, dict[str, Any]] = {}
        self.server = None
        self._shown = 0.0
        if metrics_port is not None:
            from ..transport.metrics import serve

            self.server = serve(lambda: [{**snap, "endpoint": who} for who, snap in list(self.stats.items())],
                                config.host, metrics_port)
            sys.stderr.write(f"kvplan load: metrics on http://{config.host}:{self.server.port}/metrics\n")

    def update(self, who: str, snap: dict[str, Any], started: float) -> None:
        self.stats[who] = snap
        now = time.monotonic()
        if self.progress and now - self._shown >= 0.25:
            self._shown = now
            decodes = [s for w, s in self.stats.items() if w != "prefill"]
            done = sum(s["requests"].get("complete", 0) for s in decodes)
            failed = sum(s["requests"].get("failed", 0) for s in decodes)
            flight = sum(s["in_flight"] for s in decodes)
            at = now - started
            when = (f"{max(at, 0.0):4.1f} of {self.config.duration:g} s of arrivals" if at < self.config.duration
                    else f"arrivals over, draining ({at:.1f} s)")
            sys.stderr.write(f"\r[load] {when}: {done} completed, {failed} failed (injected faults included), "
                             f"{flight} in flight   ")
            sys.stderr.flush()

    def close(self) -> None:
        if self.progress:
            sys.stderr.write("\n")
        if self.server is not None:
            self.server.close()


def _collect(config: LoadConfig, procs: list[tuple[Any, Any, str]], started: float, wait: float,
             live: _Live) -> LoadReport:
    """Every process's results (killing the last decode at ``kill_at``), then the report."""
    arrivals = {a.request: a for a in schedule(config)}
    report = LoadReport(config, requests=len(arrivals))
    killed = procs[config.decodes - 1][2] if config.kill_at else None
    results: dict[str, tuple] = {}
    deadline = time.monotonic() + wait
    try:
        while len(results) < len(procs) and time.monotonic() < deadline:
            if killed and time.monotonic() >= started + config.kill_at and killed not in results:
                proc = procs[config.decodes - 1][0]
                proc.kill()
                proc.join(5)
                results[killed] = ("killed",)
                live.stats.pop(killed, None)
                log.warning("load: killed %s at %.1f s", killed, config.kill_at)
            for _, conn, who in procs:
                if who not in results and conn.poll(0.01):
                    msg = child_message(conn, who, 1)
                    if msg[0] == "progress":
                        live.update(who, msg[1], started)
                    else:
                        results[who] = msg
    finally:
        live.close()
    report.stats = dict(live.stats)
    missing = [who for _, _, who in procs if who not in results]
    if missing:
        raise TimeoutError(f"no result from {missing} within {wait:.0f} s")
    sent = results["prefill"][1]
    report.resources["prefill"] = results["prefill"][2]
    report.unsettled = results["prefill"][3]
    done: dict[str, dict[str, Any]] = {}
    for k in range(config.decodes):
        result = results[f"decode {k}"]
        if result[0] == "killed":
            continue
        _, outcomes, samples, quarantined, unsettled = result
        done.update(outcomes)
        report.resources[f"decode {k}"] = samples
        report.quarantined += quarantined
        report.unsettled += unsettled
    latencies, moved, phases = [], 0, {}
    for request, a in arrivals.items():
        if a.fault:
            report.faults[a.fault] = report.faults.get(a.fault, 0) + 1
        here, there = done.get(request), sent.get(request, {})
        if killed is not None and a.decode == config.decodes - 1:
            report.with_killed_decode += 1
            continue
        if here is not None and here["state"] == "complete":
            report.completed += 1
            report.verified += bool(here["ok"])
            if not here["ok"]:
                report.problems.append(f"request {request}: a byte differs from what its source wrote")
            if here.get("disagree"):
                report.problems.append(here["disagree"])
            if a.fault:
                report.problems.append(f"request {request}: its {a.fault} fault was not observed")
            if there.get("state") == "sent":
                latencies.append((here["at"] - there["ready"]) * 1e3)
                stamps = {**there, **here}
                for name, (start, end) in PHASES.items():
                    if stamps.get(start) is not None and stamps.get(end) is not None:
                        phases.setdefault(name, []).append((stamps[end] - stamps[start]) * 1e3)
            moved += (a.prompt_len - a.prefix_len) * 2 * config.layers * config.token_bytes
            continue
        reason = (here or {}).get("reason") or there.get("reason") or "no outcome"
        cause = _cause(reason)
        report.failures[cause] = report.failures.get(cause, 0) + 1
        if cause == "overload":  # refused at admission, before any page was written: the bound at work
            continue
        if cause != a.fault:
            report.unexpected[cause] = report.unexpected.get(cause, 0) + 1
            report.problems.append(f"request {request} failed without a fault of that kind ({a.fault}): {reason}")
    if latencies:
        report.latency_ms = {"p50": round(float(np.percentile(latencies, 50)), 3),
                             "p99": round(float(np.percentile(latencies, 99)), 3)}
    report.phases_ms = {name: {"p50": round(float(np.percentile(v, 50)), 3), "p99": round(float(np.percentile(v, 99)), 3)}
                        for name, v in phases.items()}
    # over the run as it went: from the start to the last completion (a run that cannot keep up takes longer
    # than its arrivals)
    ends = [o["at"] for o in done.values() if o["state"] == "complete"]
    span = max(max(ends, default=started) - started, config.duration, 1e-9)
    report.throughput = {"offered_per_s": round(len(arrivals) / config.duration, 2),
                         "requests_per_s": round(report.completed / span, 2), "span_s": round(span, 2),
                         "gib_per_s": round(moved / span / 2**30, 4)}
    _check_resources(report)
    return report


def _check_resources(report: LoadReport) -> None:
    """Tables drained, and nothing grew between the run's first sample and its last."""
    if report.unsettled:
        report.problems.append(f"{report.unsettled} requests never settled")
    if report.quarantined:
        report.problems.append(f"{report.quarantined} failed requests were never fenced (their pages stay out of use)")
    for who, samples in report.resources.items():
        if not samples:
            continue
        # against the run's first quarter (an engine connects and keeps its handles on first use)
        first = next((x for x in samples if x["t"] >= report.config.duration / 4), samples[0])
        last = samples[-1]
        left = {k: v for k, v in last.items() if k in _TABLES and v}
        if left:
            report.problems.append(f"{who}: its tables did not drain: {left}")
        for key in ("fds", "sockets", "engine_regions", "engine_handles"):
            # an engine may open connections and keep handles up to bounds it declares (Mooncake's TCP lanes
            # per peer; the handles NIXL keeps for reposting)
            allowed = 2 + last.get("engine_connections_max", 0) if key in ("fds", "sockets") else 0
            if key == "engine_handles":
                allowed = max(0, last.get("engine_handles_max", 0) - first[key])
            if key in last and last[key] > first[key] + allowed:
                report.problems.append(f"{who}: {key} grew from {first[key]} to {last[key]} (allowed: +{allowed})")


_TABLES = ("tracked", "published", "owners", "own_lists", "fences", "waves", "early_waves", "runs", "lists",
           "planning", "backlog")
