"""``kvplan load --find-capacity``: the highest arrival rate the endpoints keep up with.

A rate *holds* when its run (:func:`~kvplan.tools.load.run_load`, the same configuration but for the
rate) is OK (every byte equal, every failure an injected one, every table drained), refused nothing
as ``overload``, completed at least :data:`KEEP_UP` of its requests (those with no injected fault), and kept its p99 latency
(last chunk ready to decode-ready) within the bound. The search doubles the rate from the
configuration's until a rate fails to hold, then bisects between the last that held and the first
that did not, ``steps`` times. Each probe is a whole run of ``duration`` seconds.

Example::

    found = find_capacity(LoadConfig(rate=200, duration=4, device="cuda"), p99_ms=50)
    found.capacity, [p.rate for p in found.probes]
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from .load import LoadConfig, LoadReport, run_load

__all__ = ["CapacityReport", "KEEP_UP", "Probe", "find_capacity", "holds"]

KEEP_UP = 0.9  # the share of the offered rate a run must complete to hold
MAX_DOUBLINGS = 12


@dataclass
class Probe:
    """One run of the search: its rate, whether it held and why not, and its numbers."""

    rate: float
    held: bool
    why: str
    completed_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    caller_us: dict[str, float]


@dataclass
class CapacityReport:
    """The search: every probe in the order run, and the highest rate that held (0: none did)."""

    p99_ms: float
    probes: list[Probe] = field(default_factory=list)

    @property
    def capacity(self) -> float:
        return max((p.rate for p in self.probes if p.held), default=0.0)

    def lines(self) -> list[str]:
        out = [f"capacity      {self.capacity:g} requests/s offered: the highest rate that held (p99 within "
               f"{self.p99_ms:g} ms, at least {KEEP_UP:.0%} of its requests completed, no overload refusal, every byte equal)"]
        for p in self.probes:
            caller = ", ".join(f"{who} {us:,.0f} us" for who, us in p.caller_us.items())
            out.append(f"  {p.rate:>9.1f}/s  {'held' if p.held else 'FAILED'}  {p.completed_per_s:8.1f}/s done, "
                       f"p50 {_ms(p.p50_ms)}, p99 {_ms(p.p99_ms)}; caller {caller or '-'}"
                       + ("" if p.held else f"  ({p.why})"))
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"p99_ms": self.p99_ms, "capacity": self.capacity, "probes": [vars(p) for p in self.probes]}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def holds(report: LoadReport, p99_ms: float) -> tuple[bool, str]:
    """Whether a run held, and if not, why (see the module docstring)."""
    # a short run's rates move with its arrivals' luck and its drain: the share of requests completed
    # (those with no injected fault) and the p99 say whether it kept up
    p99 = report.latency_ms.get("p99")
    clean = report.requests - sum(report.faults.values())
    if not report.ok:
        return False, "problems: " + "; ".join(report.problems[:2])
    if report.failures.get("overload"):
        return False, f"{report.failures['overload']} refused as overload"
    if report.completed < KEEP_UP * clean:
        return False, f"completed {report.completed} of {clean} requests"
    if p99 is None or p99 > p99_ms:
        return False, f"p99 {_ms(p99)} over {p99_ms:g} ms"
    return True, ""


def find_capacity(config: LoadConfig, p99_ms: float, steps: int = 3,
                  run: Callable[[LoadConfig], LoadReport] = run_load,
                  progress: Callable[[Probe], None] | None = None) -> CapacityReport:
    """Search the highest rate that holds (see the module docstring); ``run`` makes one probe."""
    if not p99_ms > 0:
        raise ValueError(f"the p99 bound must be positive, got {p99_ms}")
    found = CapacityReport(p99_ms)

    def probe(rate: float) -> bool:
        report = run(replace(config, rate=rate))
        held, why = holds(report, p99_ms)
        found.probes.append(Probe(rate, held, why, report.throughput.get("requests_per_s", 0.0),
                                  report.latency_ms.get("p50"), report.latency_ms.get("p99"),
                                  report.caller_us_per_request()))
        if progress is not None:
            progress(found.probes[-1])
        return held

    rate = config.rate
    if not probe(rate):  # even the first rate fails: bisect below it
        good, bad = 0.0, rate
    else:
        good, bad = rate, None
        for _ in range(MAX_DOUBLINGS):
            rate *= 2
            if not probe(rate):
                bad = rate
                break
            good = rate
        if bad is None:
            return found
    for _ in range(steps):
        middle = (good + bad) / 2
        if probe(middle):
            good = middle
        else:
            bad = middle
    return found
