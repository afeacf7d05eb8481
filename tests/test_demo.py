"""``kvplan demo`` as a user runs it: the command line, end to end, on this machine."""

import subprocess
import sys

import pytest


@pytest.mark.engines
def test_demo_command_moves_and_verifies_the_default_batch():
    done = subprocess.run([sys.executable, "-m", "kvplan", "demo", "--requests", "4", "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every byte matches" in done.stdout and "result        OK" in done.stdout


@pytest.mark.engines
def test_demo_fault_drill_exits_non_zero_and_says_why():
    done = subprocess.run([sys.executable, "-m", "kvplan", "demo", "--requests", "2", "--fault", "deadline",
                           "--no-progress"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "deadline passed" in done.stdout and "FAILED" in done.stdout


def test_bad_options_get_a_clear_message():
    done = subprocess.run([sys.executable, "-m", "kvplan", "demo", "--mode", "prepared", "--engine", "mooncake"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "prepared lists are NIXL's" in done.stderr
    done = subprocess.run([sys.executable, "-m", "kvplan", "demo", "--requests", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "must be >= 1" in done.stderr
