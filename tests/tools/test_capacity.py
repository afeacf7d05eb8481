"""``kvplan load --find-capacity``: the search over rates, with a stand-in for the load run (whose
p99 grows with the rate), and its refusals on the command line."""

from __future__ import annotations

from kvplan.tools.capacity import find_capacity, holds
from kvplan.tools.load import LoadConfig, LoadReport
from tests.tools.cli import run_cli


def _run_with_knee(knee: float):
    """A load run that keeps up below ``knee`` requests/s (p99 10 ms) and falls behind above it."""
    rates = []

    def run(config: LoadConfig) -> LoadReport:
        rates.append(config.rate)
        report = LoadReport(config, requests=int(config.rate * config.duration))
        done = min(config.rate, knee)
        report.completed = int(done * config.duration)
        report.throughput = {"offered_per_s": config.rate, "requests_per_s": done}
        report.latency_ms = {"p50": 5.0, "p99": 10.0 if config.rate <= knee else 900.0}
        return report

    return run, rates


def test_the_search_doubles_then_bisects_to_within_its_steps_of_the_knee():
    run, rates = _run_with_knee(350.0)
    found = find_capacity(LoadConfig(rate=100, duration=1), p99_ms=50, steps=3, run=run)
    assert rates == [100, 200, 400, 300, 350, 375]
    assert found.capacity == 350 and [p.held for p in found.probes] == [True, True, False, True, True, False]
    assert "capacity      350 requests/s" in "\n".join(found.lines())


def test_a_first_rate_that_fails_bisects_below_it():
    run, rates = _run_with_knee(30.0)
    found = find_capacity(LoadConfig(rate=100, duration=1), p99_ms=50, steps=2, run=run)
    assert rates == [100, 50, 25] and found.capacity == 25


def test_a_run_holds_only_when_ok_without_overload_keeping_up_within_the_bound():
    report = LoadReport(LoadConfig(rate=10), requests=10, completed=9, faults={"abort": 1})
    report.throughput, report.latency_ms = {"offered_per_s": 10, "requests_per_s": 9.5}, {"p99": 20.0}
    assert holds(report, 50) == (True, "")
    report.completed = 7
    assert holds(report, 50)[1] == "completed 7 of 9 requests"
    report.completed = 9
    assert holds(report, 10)[1] == "p99 20.0 ms over 10 ms"
    report.failures["overload"] = 2
    assert not holds(report, 50)[0]
    report.failures.clear()
    report.problems.append("request q1: a byte differs")
    assert holds(report, 50)[1].startswith("problems: request q1")


def test_the_capacity_options_that_cannot_run_are_refused(capsys, monkeypatch):
    code, _, err = run_cli(["load", "--find-capacity", "0"], capsys, monkeypatch)
    assert code == 2 and "must be a positive number" in err
    code, _, err = run_cli(["load", "--find-capacity", "50", "--metrics-port", "0"], capsys, monkeypatch)
    assert code == 2 and "not with --metrics-port" in err
