"""Without a GPU and without Triton's interpreter, kvplan says what to set instead of Triton's
"0 active drivers"."""

import os
import subprocess
import sys

import pytest

SCRIPT = """
import numpy as np
from kvplan.errors import KvplanError
from kvplan.planner.device import Planner
from kvplan.planner.model import Attention, Entry, KVLayout, SideMemory
side = SideMemory(KVLayout(Attention.MLA, 4, (Entry(0x1000, 64, 8),)), req_to_token=np.zeros((2, 8), np.int32))
try:
    Planner(side, (side,))
except KvplanError as err:
    print("KVPLAN:", err)
"""


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks the CPU machine's set-up")
def test_planning_cpu_tensors_without_the_interpreter_names_the_setting():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert "KVPLAN:" in done.stdout and "TRITON_INTERPRET=1" in done.stdout, done.stdout + done.stderr
