"""The command line as a new user meets it: refusals before any process starts, named, exit code 2,
one line of hint instead of the whole usage; an engine that is not installed named with its extra;
every option explained; the load tool's report labelling what it injected."""

from __future__ import annotations

import logging
import time

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
    (["--engine-setting", "warp=9"], "nixl has no setting 'warp'"),
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


@pytest.mark.parametrize("variable, value, message", [
    ("KVPLAN_DRAIN_S", "abc", "KVPLAN_DRAIN_S='abc': not a number; it takes a number >= 0"),
    ("KVPLAN_DRAIN_S", "-1", "KVPLAN_DRAIN_S='-1': below 0"),
    ("KVPLAN_DRAIN_S", "inf", "KVPLAN_DRAIN_S='inf': not a finite number"),
    ("KVPLAN_COPY_GRAPHS", "maybe", "KVPLAN_COPY_GRAPHS='maybe': not a switch; it takes `1` or `0`"),
    ("KVPLAN_SGLANG", "maybe", "KVPLAN_SGLANG='maybe': not a switch"),
    ("KVPLAN_TRACE", "sometimes", "KVPLAN_TRACE='sometimes': not a switch"),
    ("KVPLAN_SECRET_FILE", "/nonexistent/kvplan-secret", "KVPLAN_SECRET_FILE='/nonexistent/kvplan-secret': no readable "
                                                          "file there"),
    ("KVPLAN_SECRET", "  ", "KVPLAN_SECRET='  ': empty: an empty secret authenticates anyone"),
    ("KVPLAN_CONFIG", "/nonexistent/kvplan.json", "no readable file there"),
])
@pytest.mark.parametrize("command", [["demo"], ["load"]])
def test_a_bad_variable_is_named_in_one_line_before_any_process_starts(variable, value, message, command, capsys,
                                                                       monkeypatch, no_run):
    monkeypatch.setenv(variable, value)
    started = time.monotonic()
    code, _, err = run_cli(command, capsys, monkeypatch)
    assert code == 2 and err.splitlines() == [f"kvplan: {err.splitlines()[0][len('kvplan: '):]}"], err
    assert message in err and "Traceback" not in err, err
    assert time.monotonic() - started < 5


def test_two_bad_variables_are_named_together(capsys, monkeypatch, no_run):
    monkeypatch.setenv("KVPLAN_COPY_GRAPHS", "maybe")
    monkeypatch.setenv("KVPLAN_DRAIN_S", "-1")
    code, _, err = run_cli(["demo"], capsys, monkeypatch)
    assert code == 2 and len(err.splitlines()) == 2, err
    assert "KVPLAN_COPY_GRAPHS='maybe'" in err and "KVPLAN_DRAIN_S='-1'" in err


def test_a_bad_log_level_is_named_and_a_good_one_is_honoured(capsys, monkeypatch, no_run):
    from kvplan import cli
    from kvplan.tools import preflight

    monkeypatch.setenv("KVPLAN_LOG_LEVEL", "loud")
    assert cli.main(["demo"]) == 2
    assert "KVPLAN_LOG_LEVEL='loud': not a log level" in capsys.readouterr().err
    monkeypatch.setenv("KVPLAN_LOG_LEVEL", "debug")
    assert preflight.log_level(0) == logging.DEBUG and preflight.log_level(1) == logging.INFO  # (-v wins)
    monkeypatch.delenv("KVPLAN_LOG_LEVEL")
    assert preflight.log_level(0) == logging.WARNING


def test_the_interpreter_switched_off_without_a_gpu_is_named_before_any_process_starts(capsys, monkeypatch, no_run):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    code, _, err = run_cli(["demo"], capsys, monkeypatch)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "TRITON_INTERPRET='0' and no CUDA device" in err and "unset TRITON_INTERPRET" in err


@pytest.mark.parametrize("args, message", [
    (["--engine", "mooncake", "--engine-setting", "protocol=carrierpigeon"],
     "--engine-setting: mooncake's protocol='carrierpigeon'; it takes one of tcp, rdma"),
    (["--engine", "mooncake", "--engine-setting", "lanes=-2"], "mooncake's lanes=-2; it takes a count >= 0"),
    (["--engine", "nixl", "--engine-setting", "num_threads=many"], "nixl's num_threads='many'; it takes a count"),
    (["--engine", "nixl", "--engine-setting", "warp=9"], "nixl has no setting 'warp'; its settings: num_threads"),
    (["--engine", "ipc", "--engine-setting", "protocol=tcp"], "ipc has no setting 'protocol'; its settings: none"),
])
@pytest.mark.parametrize("command", ["demo", "load"])
def test_an_engine_setting_the_engine_does_not_take_is_named_before_any_process_starts(args, message, command, capsys,
                                                                                      monkeypatch, no_run):
    code, _, err = run_cli([command, *args], capsys, monkeypatch)
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
