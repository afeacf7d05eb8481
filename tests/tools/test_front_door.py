"""The command line as a new user meets it: refusals before any process starts, named, exit code 2,
one line of hint instead of the whole usage; an engine that is not installed named with its extra;
every option explained; the load tool's report labelling what it injected."""

from __future__ import annotations

import pytest

from kvplan.cli import build_parser
from kvplan.tools.load import LoadConfig, LoadReport
from tests.tools.cli import run_cli


@pytest.fixture
def no_run(monkeypatch):
    """Fail the test if a command gets as far as starting its processes."""
    def started(*args, **kwargs):
        raise AssertionError("the command started its processes before refusing")

    monkeypatch.setattr("kvplan.tools.load.run_load", started)
    monkeypatch.setattr("kvplan.tools.demo.run_demo", started)
    monkeypatch.setattr("kvplan.tools.demo.run_role", started)


def test_a_bad_option_prints_one_line_and_a_hint_not_the_whole_usage(capsys, monkeypatch):
    code, _, err = run_cli(["demo", "--requests", "0"], capsys, monkeypatch)
    assert code == 2 and "usage:" not in err, err
    assert err.splitlines() == ["kvplan demo: error: argument --requests: must be >= 1, got 0",
                                "(see 'kvplan demo --help')"]


@pytest.mark.parametrize("args, message", [
    (["--rate", "-1"], "argument --rate: must be a positive number, got -1"),
    (["--rate", "0"], "argument --rate: must be a positive number, got 0"),
    (["--duration", "0"], "argument --duration: must be a positive number"),
    (["--timeout", "0"], "argument --timeout: must be a positive number"),
    (["--forward-tokens-per-s", "0"], "argument --forward-tokens-per-s: must be a positive number"),
    (["--prefix-share", "2"], "argument --prefix-share: must be a share of the requests in [0, 1], got 2"),
    (["--engine", "mooncake", "--mode", "prepared"], "--mode prepared needs --engine nixl"),
    (["--duration", "3", "--kill-at", "5"], "--kill-at 5 must fall inside the run's arrivals"),
    (["--duration", "3", "--kill-at", "-1"], "--kill-at -1 must fall inside the run's arrivals"),
    (["--decodes", "1", "--kill-at", "1"], "--kill-at needs at least two decodes"),
    (["--chunk-tokens", "20"], "is not a multiple of the page size"),
    (["--prompt-max", "8"], "--prompt-max 8 is shorter than a page"),
    (["--engine-setting", "warp=9"], "nixl has no such setting"),
])
def test_load_refuses_what_cannot_run_before_any_process_starts(args, message, capsys, monkeypatch, no_run):
    code, _, err = run_cli(["load", *args], capsys, monkeypatch)
    assert code == 2 and message in err and "usage:" not in err, err


@pytest.mark.parametrize("command", [["demo"], ["load"]])
def test_an_engine_that_is_not_installed_is_named_with_the_extra_that_installs_it(command, capsys, monkeypatch,
                                                                                   no_run):
    from kvplan.transport.engines import registry

    def missing():
        raise ImportError("No module named 'mooncake'")

    monkeypatch.setitem(registry._PROBES, "mooncake", (missing, registry._PROBES["mooncake"][1]))
    code, _, err = run_cli([*command, "--engine", "mooncake", "--device", "cpu"], capsys, monkeypatch)
    assert code == 2 and "mooncake is not installed here (No module named 'mooncake')" in err, err
    assert "extra mooncake" in err and "Traceback" not in err


def test_a_prompt_shorter_than_its_chunks_names_the_prompt_length(capsys, monkeypatch, no_run):
    code, _, err = run_cli(["demo", "--prompt-len", "7"], capsys, monkeypatch)
    assert code == 2 and "--prompt-len 7 is 1 page of 16 tokens" in err and "fewer --chunks" in err, err


def test_every_option_of_every_command_says_what_it_does():
    parser = build_parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        for action in sub._actions:
            assert action.help, f"kvplan {name} {action.option_strings}: no help text"


def test_the_load_report_labels_injected_faults_and_says_the_cpu_is_no_speed_measurement():
    report = LoadReport(LoadConfig(device="cpu"), requests=10, completed=7, verified=7,
                        failures={"abort": 2, "deadline": 1}, faults={"abort": 2, "deadline": 1})
    lines = "\n".join(report.lines())
    assert "injected      abort 2, deadline 1 (faults on the schedule" in lines
    assert "failed        3: 3 injected (abort 2, deadline 1)" in lines
    assert "(CPU, Triton interpreter: not a speed measurement)" in lines
    report.failures["decode gone"], report.unexpected["decode gone"] = 2, 2
    assert "failed        5: 3 injected (abort 2, deadline 1); 2 NOT injected (decode gone 2)" in "\n".join(report.lines())
    report.failures["overload"] = 4
    assert "failed        9: 4 refused at admission as overload (nothing written); 3 injected" in "\n".join(report.lines())


def test_the_demo_report_says_a_staged_batch_went_through_staging():
    from kvplan.tools.demo import DemoConfig, DemoReport

    report = DemoReport(DemoConfig(mode="staged"), device="cpu", transfers=4, mode="direct", mode_used="staged")
    assert "(direct descriptors, moved through staging slots)" in report.render()
    report = DemoReport(DemoConfig(mode="auto"), device="cpu", transfers=4, mode="direct", mode_used="direct")
    assert "(direct descriptors)" in report.render()
