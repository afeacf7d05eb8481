"""The scripts in examples/ run as a user would run them."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def run(name: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_plan_a_batch():
    assert "equal to the reference" in run("plan_a_batch.py")


@pytest.mark.engines
def test_handoff_in_process():
    assert "every byte matches" in run("handoff_in_process.py")
