"""The planner object with CUDA graphs: replayed plans equal eager ones, buckets, buffer reuse."""

import os
from dataclasses import replace

import pytest
import torch

from kvplan.errors import InputError
from kvplan.planner.device import eager
from kvplan.planner.device.columns import BatchColumns
from kvplan.planner.device.planner import Planner
from kvplan.tools.scenarios import PRESETS, build_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "0",
    reason="CUDA graphs need a CUDA device and compiled kernels")]


def resident(batch):
    """The batch's source side with its token table and slot maps on the GPU, as a serving engine keeps them."""
    return replace(batch, src=batch.src.to("cuda"))


def refill(side, batch):
    """Copy a new batch's table and maps into the persistent tensors of ``side`` (same shapes)."""
    side.req_to_token.copy_(torch.as_tensor(batch.src.req_to_token))
    for mine, theirs in zip(side.state, batch.src.state):
        if mine.slot_map is not None:
            mine.slot_map.copy_(torch.as_tensor(theirs.slot_map))


@pytest.mark.parametrize("preset", ["llama70b-tp8-p64", "gptoss-swa-p16", "qwen3next-mamba-p64", "llama70b-tp4to8-p64"])
def test_replayed_plans_equal_eager_plans(preset):
    shape = PRESETS[preset].scaled(layers=4)
    first = resident(build_batch(shape, requests=4, prompt_len=[300, 129, 1000, 64], chunks=2, seed=0))
    planner = Planner(first.src, first.dsts, graphs=True, outputs=("descriptors", "runs"))
    for seed in range(5):  # new pages and slots each time; eager, capture, replays; 5..8 transfers, one bucket
        batch = build_batch(shape, requests=4, prompt_len=[300, 129, 1000, 64], chunks=2, seed=seed)
        refill(first.src, batch)
        batch = replace(batch, src=first.src, dsts=first.dsts, transfers=batch.transfers[: 5 + seed % 4])
        pending = planner.plan(BatchColumns.from_batch(batch))
        descs, offsets = pending.descriptors()
        expected = eager.plan(batch)
        want_descs, want_offsets = expected.descriptors()
        assert (descs == want_descs).all() and (offsets == want_offsets).all()
        pending.result().assert_equal(expected.result())
    assert planner.replays == 4  # the first plan of the bucket runs eagerly; each of the 2 slots is captured once


def test_a_plan_is_invalid_once_its_buffers_are_reused():
    batch = resident(build_batch(PRESETS["llama70b-tp8-p64"].scaled(layers=2), requests=2, prompt_len=[300, 129]))
    planner = Planner(batch.src, batch.dsts, graphs=True, depth=2)
    cols = BatchColumns.from_batch(batch)
    old = planner.plan(cols)
    planner.plan(cols)
    planner.plan(cols)  # reuses old's slot
    with pytest.raises(InputError, match="reused"):
        old.descriptors()


@pytest.mark.parametrize("preset", ["llama70b-tp8-p64", "qwen3next-mamba-p64", "llama70b-tp4to8-p64"])
def test_after_warm_up_the_first_plan_of_each_bucket_replays_a_graph(preset):
    shape = PRESETS[preset].scaled(layers=4)
    lens = [300, 129, 1000, 64]
    first = resident(build_batch(shape, requests=4, prompt_len=lens, chunks=2, seed=0))
    planner = Planner(first.src, first.dsts, graphs=True, outputs=("descriptors", "byte_offsets"))
    per_transfer = max(len(BatchColumns.from_batch(first).dst_flat) // len(first.transfers), 1) * 2
    assert planner.warm_up(max_transfers=16, elements_per_transfer=per_transfer) >= 2
    for seed, chunks, count in [(1, 2, 8), (2, 2, 3), (3, 4, 16)]:  # three sizes, two transfer buckets
        batch = build_batch(shape, requests=4, prompt_len=lens, chunks=chunks, seed=seed)
        refill(first.src, batch)
        batch = replace(batch, src=first.src, dsts=first.dsts, transfers=batch.transfers[:count])
        before = planner.replays
        pending = planner.plan(BatchColumns.from_batch(batch))
        assert planner.replays == before + 1  # a graph, not an eager first plan
        descs, offsets = pending.descriptors()
        want_descs, want_offsets = eager.plan(batch).descriptors()
        assert (descs == want_descs).all() and (offsets == want_offsets).all()
