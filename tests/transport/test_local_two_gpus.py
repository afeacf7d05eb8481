"""In-process execution across two GPUs with peer access: the source pool on one card, the
destination pool on the other; direct and staged, byte for byte against the reference."""

import os

import pytest
import torch

from kvplan.planner.device import eager
from kvplan.planner.contract.batch import Batch
from kvplan.planner.reference.oracle import plan_reference
from kvplan.tools.scenarios import PRESETS, build_batch, materialize
from kvplan.transport.local import gather, plan_alignment, run_direct, scatter, staging_offsets
from kvplan.tools.verify import AddressSpace, execute

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "0" or torch.cuda.device_count() < 2
    or not torch.cuda.can_device_access_peer(0, 1), reason="needs two GPUs with peer access")]


@pytest.mark.parametrize("preset", ["gptoss-swa-p16", "llama70b-tp4to8-p64", "qwen3next-mamba-p64"])
@pytest.mark.parametrize("staged", [False, True])
def test_plan_moves_between_two_gpus(preset, staged):
    batch = build_batch(PRESETS[preset].scaled(layers=2), requests=3, prompt_len=[300, 129, 1000], chunks=2, seed=4)
    src, src_tensors = materialize(batch.src, "cuda:0", seed=9)
    dst, dst_tensors = materialize(batch.dsts[0], "cuda:1")
    real = Batch(src, (dst,), batch.transfers)
    torch.zeros(1, device="cuda:1").copy_(torch.zeros(1, device="cuda:0"))  # torch enables peer access
    expected = AddressSpace.of_tensors(dst_tensors, zero=True)
    execute(plan_reference(real).descriptors()[0], AddressSpace.of_tensors(src_tensors), expected)
    descs = eager.plan(real.to("cuda:0")).device_descriptors()
    align = plan_alignment(real)
    if staged:  # gather on card 0, one copy of the staging region, scatter on card 1
        offsets, ends = staging_offsets(descs)
        near = torch.empty(int(ends[-1]), dtype=torch.uint8, device="cuda:0")
        far = torch.empty_like(near, device="cuda:1")
        gather(descs, offsets, near, align)
        far.copy_(near)
        torch.cuda.synchronize("cuda:0")
        with torch.cuda.device(1):
            scatter(descs.to("cuda:1"), offsets.to("cuda:1"), far, align)
    else:
        run_direct(descs, align)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    assert expected.matches(dst_tensors)
