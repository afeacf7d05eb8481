"""The scripts in examples/ run as a user would run them."""

import os
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


@pytest.mark.engines
@pytest.mark.sglang
def test_sglang_integration():
    """Run as an SGLang deployment would, with SGLang 0.5.23 importable (tests/sglang_real.py)."""
    pytest.importorskip("sglang")
    script = EXAMPLES / "sglang_integration.py"
    # the command its docstring prints for the CPU environment of make setup-sglang
    done = subprocess.run([sys.executable, "-m", "tests.sglang_real", str(script.relative_to(EXAMPLES.parent))],
                          capture_output=True, text=True, timeout=600, cwd=EXAMPLES.parent,
                          env={**os.environ, "UCX_NET_DEVICES": "lo", "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every byte matches" in done.stdout, done.stdout
