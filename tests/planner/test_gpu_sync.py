"""On a GPU, ``plan`` issues no synchronizing call on the caller's stream."""

import os

import pytest
import torch

from kvplan.planner import gpu
from kvplan.planner.reference import plan_reference
from kvplan.scenarios import PRESETS, build_batch
from tests.planner.test_gpu_planner import on_device

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "0",
                    reason="needs a CUDA device and compiled kernels")
@pytest.mark.parametrize("preset", ["gptoss-swa-p16", "dsv32-mla-dsa-p64", "qwen3next-mamba-p64", "llama70b-tp4to8-p64"])
def test_plan_makes_no_synchronizing_call(preset):
    batch = build_batch(PRESETS[preset].scaled(layers=2), requests=4, prompt_len=[300, 129, 1000, 64], chunks=2,
                        prefix_len=64, seed=5)
    device_batch = on_device(batch, torch.device("cuda"))
    gpu.plan(device_batch).result()  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = gpu.plan(device_batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    pending.result().assert_equal(plan_reference(batch))


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "0",
                    reason="needs a CUDA device and compiled kernels")
@pytest.mark.parametrize("preset", ["gptoss-swa-p16", "dsv32-mla-dsa-p64", "qwen3next-mamba-p64"])
def test_publishing_destinations_makes_no_synchronizing_call(preset):
    from kvplan.planner.destinations import PreallocatedRequest, plan_destinations
    from kvplan.planner.reference import destination_lists
    from tests.planner.test_destinations import side_on

    batch = build_batch(PRESETS[preset].scaled(layers=2), requests=4, prompt_len=[300, 129, 1000, 64], seed=5)
    side = side_on(batch.dsts[0], torch.device("cuda"))
    requests = [PreallocatedRequest(f"req{r}", r, n) for r, n in zip(range(1, 5), [300, 129, 1000, 64])]
    plan_destinations(side, requests).result()  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = plan_destinations(side, requests)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for r, published in zip(requests, pending.result()):
        want = destination_lists(batch.dsts[0], r.row, 0, r.prompt_len)
        assert (published.lists.pages == want.pages).all()
