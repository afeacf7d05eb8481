"""CUDA-graph replay of the planner (the stretch target of benchmarks.md): bit-identical to eager."""

import os

import pytest
import torch

from kvplan.planner import gpu
from kvplan.planner.graphs import GraphPlanner
from kvplan.scenarios import PRESETS, build_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "0",
    reason="CUDA graphs need a CUDA device and compiled kernels")]


def into(store: dict, batch):
    """The batch with its token table and slot maps copied into tensors that persist across calls,
    as a serving engine's do (a graph reads its inputs where they were at capture)."""
    from dataclasses import replace

    def keep(name, values):
        values = torch.as_tensor(values)
        tensor = store.setdefault((name, tuple(values.shape)), torch.empty_like(values, device="cuda"))
        return tensor.copy_(values)

    state = tuple(replace(c, slot_map=None if c.slot_map is None else keep(f"map{i}", c.slot_map))
                  for i, c in enumerate(batch.src.state))
    return replace(batch, src=replace(batch.src, state=state, req_to_token=keep("table", batch.src.req_to_token)))


@pytest.mark.parametrize("preset", ["llama70b-tp8-p64", "gptoss-swa-p16", "qwen3next-mamba-p64", "llama70b-tp4to8-p64"])
def test_replayed_plans_equal_eager_plans(preset):
    planner, store = GraphPlanner(), {}
    shape = PRESETS[preset].scaled(layers=4)
    for seed in range(4):  # same shape, new pages and slots each time: eager, capture, replay, replay
        batch = into(store, build_batch(shape, requests=4, prompt_len=[300, 129, 1000, 64], chunks=2, seed=seed))
        pending = planner.plan(batch)
        descs, offsets = pending.descriptors()
        eager = gpu.plan(batch)
        want_descs, want_offsets = eager.descriptors()
        assert (descs == want_descs).all() and (offsets == want_offsets).all()
        pending.result().assert_equal(eager.result())
    assert planner.replays == 3


def test_a_new_shape_is_captured_anew():
    planner, store = GraphPlanner(), {}
    shape = PRESETS["llama70b-tp8-p64"].scaled(layers=2)
    for lengths in ([300, 129], [300, 129], [640, 64], [640, 64], [300, 129]):
        batch = into(store, build_batch(shape, requests=2, prompt_len=lengths, seed=1))
        descs, _ = planner.plan(batch).descriptors()
        assert (descs == gpu.plan(batch).descriptors()[0]).all()
    assert planner.replays == 3
