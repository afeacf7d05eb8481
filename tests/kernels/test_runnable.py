"""Without a GPU and without Triton's interpreter, kvplan says what to set instead of Triton's
"0 active drivers"."""

import os
import subprocess
import sys

import pytest

SCRIPT = """
import numpy as np
from kvplan.errors import KvplanError
from kvplan.planner.device.planner import Planner
from kvplan.planner.contract.batch import Attention, Entry, KVLayout, SideMemory
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


MIXED = """
import numpy as np
import torch
from kvplan.errors import InputError, KvplanError
from kvplan.planner.device.destinations import PreallocatedRequest, plan_destinations
from kvplan.planner.device.planner import Planner
from kvplan.planner.contract.batch import Attention, Entry, KVLayout, SideMemory, StateComponent, StateKind
swa = StateComponent(StateKind.SWA, (Entry(0x9000000, 64, 8),), window=4,
                     slot_map=torch.zeros(32, dtype=torch.int64, device="meta"))
side = SideMemory(KVLayout(Attention.MLA, 4, (Entry(0x1000, 64, 8),)), state=(swa,),
                  req_to_token=torch.zeros((2, 8), dtype=torch.int32))
for call in (lambda: Planner(side, (side,)), lambda: plan_destinations(side, [PreallocatedRequest("r1", 1, 8)])):
    try:
        call()
    except KvplanError as err:
        print("KVPLAN:", type(err).__name__, err)
"""


def test_a_slot_map_on_another_device_than_the_token_table_is_named_before_the_kernels_are_asked_for():
    """Where the kernels cannot run (here: no interpreter), inputs on two devices are still the error
    reported: an InputError that says which input is where, not the kernels' set-up."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_INTERPRET"] = "0"
    done = subprocess.run([sys.executable, "-c", MIXED], capture_output=True, text=True, timeout=120, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("KVPLAN:")]
    assert len(lines) == 2, done.stdout + done.stderr
    for line in lines:
        assert "InputError" in line and "slot_map of component" in line and "is on meta" in line, line
        assert "token table (req_to_token) on cpu" in line, line
