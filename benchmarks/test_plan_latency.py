"""pytest-benchmark: kvplan's plan latency per scenario of benchmarks.md, the SGLang-style baseline
measured in the same run; both plans must agree.

CI runs this with ``--benchmark-disable`` at tiny sizes (a test that it works). On a GPU:
``KVPLAN_BENCH_SCALE=1 KVPLAN_BENCH_GATES=1 TRITON_INTERPRET=0 python -m pytest benchmarks``; the
gates (ratio targets) are checked only when ``KVPLAN_BENCH_GATES=1``, never in CI.
"""

import os

import numpy as np
import pytest
import torch

from kvplan.baseline import sglang_style_descs
from kvplan.bench import SCENARIOS, TARGETS, median_ms
from kvplan.planner import gpu
from kvplan.scenarios import PRESETS, build_batch

SCALE = float(os.environ.get("KVPLAN_BENCH_SCALE", "0.02"))
GATES = os.environ.get("KVPLAN_BENCH_GATES") == "1"
ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0"


@pytest.fixture(scope="module", params=list(SCENARIOS))
def scenario(request):
    requests, prompt_len = SCENARIOS[request.param]
    shape = PRESETS[request.param]
    if SCALE < 1:
        shape = shape.scaled(layers=2)
        requests, prompt_len = max(1, int(requests * SCALE)), max(64, int(prompt_len * SCALE))
    batch = build_batch(shape, requests, prompt_len)
    return request.param, batch, batch.to("cuda" if ON_GPU else "cpu")


def test_plan_latency(benchmark, scenario):
    name, batch, device_batch = scenario
    baseline = sglang_style_descs(batch)
    descs = benchmark(lambda: gpu.plan(device_batch).descriptors()[0])
    assert np.array_equal(descs, baseline), "kvplan and the SGLang-style baseline disagree"
    baseline_ms = median_ms(lambda: sglang_style_descs(batch), 5 if ON_GPU else 1, warmup=0)
    benchmark.extra_info.update(descriptors=len(descs), baseline_ms=baseline_ms)
    if GATES and benchmark.stats is not None:
        ratio = baseline_ms / (benchmark.stats.stats.median * 1e3)
        benchmark.extra_info["ratio"] = ratio
        target = TARGETS["ratio_high"] if name in TARGETS["high_ratio_scenarios"] else TARGETS["ratio"]
        assert ratio >= target, f"{name}: ratio {ratio:.1f}x is under the target {target}x"
