"""pytest-benchmark: kvplan against the SGLang-style baseline; both plans must agree.

CI runs this with ``--benchmark-disable`` at tiny sizes (a test that it works); on a GPU, run
``KVPLAN_BENCH_SCALE=1 TRITON_INTERPRET=0 python -m pytest benchmarks`` for the real sizes.
"""

import os

import numpy as np
import pytest
import torch

from benchmarks.plan_latency import SCENARIOS, baseline_descs, device_batch, kvplan_descs
from kvplan.scenarios import PRESETS, build_batch

SCALE = float(os.environ.get("KVPLAN_BENCH_SCALE", "0.02"))


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def batch(request):
    requests, prompt_len = SCENARIOS[request.param]
    shape = PRESETS[request.param]
    if SCALE < 1:
        shape = shape.scaled(layers=2)
    device = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu")
    return device_batch(build_batch(shape, max(1, int(requests * SCALE)), max(64, int(prompt_len * SCALE))), device)


@pytest.mark.parametrize("planner", [kvplan_descs, baseline_descs], ids=["kvplan", "sglang-style"])
def test_plan_latency(benchmark, batch, planner):
    descs = benchmark(planner, batch)
    assert np.array_equal(descs, kvplan_descs(batch) if planner is baseline_descs else baseline_descs(batch))
