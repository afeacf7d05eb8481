"""The GPU benchmark suites (``python -m benchmarks``) hold together on the CPU: every step names a module,
script or test path that exists, and every ``kvplan`` command parses with kvplan's own argument parser, so
a suite does not find a typo after minutes of GPU time."""

import importlib.util
import os

import pytest

from benchmarks.__main__ import main
from benchmarks.suites import SUITES
from kvplan.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = [(name, step) for name, suite in SUITES.items() for step in suite.steps]


@pytest.mark.parametrize("name, step", STEPS, ids=[f"{n}/{s.name}" for n, s in STEPS])
def test_every_step_runs_something_that_exists(name, step, tmp_path):
    if name == "load" and step.name == "10k":  # (its rate comes from the probe's results)
        (tmp_path / "load-nixl-probe.json").write_text('{"throughput": {"requests_per_s": 300}}')
    command = step.command(str(tmp_path))
    if command[0] != "python3":
        assert command[0] == "nvidia-smi"
        return
    if command[1] != "-m":  # a script
        assert os.path.isfile(os.path.join(ROOT, command[1])), command
        return
    target = command[2]
    if target == "kvplan":
        build_parser().parse_args(command[3:])  # (exits 2 on an unknown or malformed option)
    elif target == "pytest":
        for arg in command[3:]:
            if arg.startswith(("tests/", "benchmarks")):
                assert os.path.exists(os.path.join(ROOT, arg.split("::")[0])), arg
    else:
        assert importlib.util.find_spec(target) is not None, target


def test_the_list_names_every_suite(capsys):
    assert main(["--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(SUITES)


def test_an_unknown_suite_is_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["no-such-suite"])
    assert stop.value.code == 2 and "unknown suites" in capsys.readouterr().err
