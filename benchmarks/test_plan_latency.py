"""pytest-benchmark: kvplan's plan latency per scenario of benchmarks.md against ``numpy-batch``,
the strongest host planner, measured in the same run; both plans must agree.

CI runs this with ``--benchmark-disable`` at tiny sizes (a test that it works). On a GPU:
``KVPLAN_BENCH_SCALE=1 KVPLAN_BENCH_GATES=1 TRITON_INTERPRET=0 python -m pytest benchmarks``; the
gates (the 10x ratio, or 1.5x the floor where copying the output bounds it) are checked only when
``KVPLAN_BENCH_GATES=1``, never in CI.
"""

import os

import numpy as np
import pytest
import torch

from kvplan.tools.bench import DST_PAGE_SIZES, SCENARIOS, TARGETS, median_ms
from kvplan.tools.host_baselines import NumpyBatchPlanner
from kvplan.planner.device.columns import BatchColumns
from kvplan.planner.device.planner import Planner
from kvplan.tools.scenarios import PRESETS, build_batch

SCALE = float(os.environ.get("KVPLAN_BENCH_SCALE", "0.02"))
GATES = os.environ.get("KVPLAN_BENCH_GATES") == "1"
ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0"


@pytest.fixture(scope="module", params=list(SCENARIOS))
def scenario(request):
    requests, prompt_len = SCENARIOS[request.param]
    preset, dst_page_size = DST_PAGE_SIZES.get(request.param, (request.param, None))
    shape = PRESETS[preset]
    if SCALE < 1:
        shape = shape.scaled(layers=2)
        requests, prompt_len = max(1, int(requests * SCALE)), max(64, int(prompt_len * SCALE))
    batch = build_batch(shape, requests, prompt_len, dst_page_size=dst_page_size).to("cuda" if ON_GPU else "cpu")
    return request.param, batch, BatchColumns.from_batch(batch)


def test_plan_latency(benchmark, scenario):
    name, batch, cols = scenario
    planner = Planner(batch.src, batch.dsts)  # graph replay on a GPU
    baseline = NumpyBatchPlanner(batch.src, batch.dsts)
    want = baseline.plan(cols)[0].copy()
    descs = benchmark(lambda: planner.plan(cols).descriptors()[0].copy())
    assert np.array_equal(descs, want), "kvplan and numpy-batch disagree"
    baseline_ms = median_ms(lambda: baseline.plan(cols), 10 if ON_GPU else 1, warmup=1 if ON_GPU else 0)
    benchmark.extra_info.update(descriptors=len(descs), baseline="numpy-batch", baseline_ms=baseline_ms)
    if GATES and benchmark.stats is not None:
        ratio = baseline_ms / (benchmark.stats.stats.median * 1e3)
        benchmark.extra_info["ratio"] = ratio
        assert ratio >= TARGETS["ratio"], f"{name}: ratio {ratio:.1f}x against numpy-batch is under {TARGETS['ratio']}x"
