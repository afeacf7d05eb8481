"""On a GPU, planning never waits for the caller's stream.

``torch.cuda.set_sync_debug_mode("error")`` misses ``torch.cuda.synchronize()`` and event waits, so
the check is direct: queue a long ``torch.cuda._sleep`` on the stream, then plan. ``plan`` must
return, and its event must still be pending, before the sleep ends. A planner that waited for the
device anywhere inside ``plan`` would return only after the sleep, and the test would fail.
"""

import os
import time

import pytest
import torch

from kvplan.planner.device import eager
from kvplan.planner.device.columns import BatchColumns
from kvplan.planner.device.planner import Planner
from kvplan.planner.reference.oracle import plan_reference
from kvplan.tools.scenarios import PRESETS, build_batch
from tests.planner.device.test_eager import on_device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "0",
    reason="needs a CUDA device and compiled kernels")]

SLEEP_S = 0.2


def _sleep_cycles() -> int:
    return int(SLEEP_S * torch.cuda.get_device_properties(0).clock_rate * 1e3)


def _returns_while_busy(call) -> tuple[float, object]:
    torch.cuda.synchronize()
    torch.cuda._sleep(_sleep_cycles())
    t0 = time.perf_counter()
    result = call()
    return time.perf_counter() - t0, result


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("preset", ["gptoss-swa-p16", "dsv32-mla-dsa-p64", "qwen3next-mamba-p64", "llama70b-tp4to8-p64"])
def test_plan_returns_before_the_busy_stream_drains(preset, graphs):
    batch = on_device(build_batch(PRESETS[preset].scaled(layers=2), requests=4, prompt_len=[300, 129, 1000, 64],
                                  chunks=2, prefix_len=64, seed=5), torch.device("cuda"))
    planner = Planner(batch.src, batch.dsts, graphs=graphs)
    cols = BatchColumns.from_batch(batch)
    for _ in range(3):  # compile, capture
        planner.plan(cols).descriptors()
    took, pending = _returns_while_busy(lambda: planner.plan(cols))
    assert not pending.ready(), "the plan's event fired before the queued sleep ended"
    assert took < SLEEP_S / 4, f"plan() took {took * 1e3:.1f} ms with the stream busy: it waited for the device"
    pending.result().assert_equal(plan_reference(batch))


@pytest.mark.parametrize("preset", ["gptoss-swa-p16", "llama70b-tp8-p64"])
def test_a_bucket_s_graph_captures_do_not_wait_either(preset):
    """A bucket's first plans capture its graphs (one per slot). ``torch.cuda.graph`` synchronizes the
    whole device on entry: a capture through it would wait for the caller's queued work (a forward
    pass, while a send streams in layer groups)."""
    batch = on_device(build_batch(PRESETS[preset].scaled(layers=2), requests=4, prompt_len=[300, 129, 1000, 64],
                                  chunks=2, prefix_len=64, seed=5), torch.device("cuda"))
    planner = Planner(batch.src, batch.dsts, graphs=True, depth=2)
    cols = BatchColumns.from_batch(batch)
    planner.plan(cols).descriptors()  # the bucket's first plan runs eagerly and compiles the kernels
    for capture in range(2):  # each of the two slots captures its graph in plan()
        took, pending = _returns_while_busy(lambda: planner.plan(cols))
        assert not pending.ready(), f"capture {capture}: the plan's event fired before the queued sleep ended"
        assert took < SLEEP_S / 4, f"capture {capture}: plan() took {took * 1e3:.1f} ms with the stream busy"
        pending.result().assert_equal(plan_reference(batch))
    assert planner.replays == 2


@pytest.mark.parametrize("preset", ["gptoss-swa-p16", "dsv32-mla-dsa-p64", "qwen3next-mamba-p64"])
def test_publishing_destinations_returns_before_the_busy_stream_drains(preset):
    from kvplan.planner.device.destinations import PreallocatedRequest, plan_destinations
    from kvplan.planner.reference.oracle import destination_lists
    from tests.planner.device.test_destinations import side_on

    batch = build_batch(PRESETS[preset].scaled(layers=2), requests=4, prompt_len=[300, 129, 1000, 64], seed=5)
    side = side_on(batch.dsts[0], torch.device("cuda"))
    requests = [PreallocatedRequest(f"req{r}", r, n) for r, n in zip(range(1, 5), [300, 129, 1000, 64])]
    plan_destinations(side, requests).result()  # compile outside the checked region
    took, pending = _returns_while_busy(lambda: plan_destinations(side, requests))
    assert took < SLEEP_S / 4, f"plan_destinations took {took * 1e3:.1f} ms with the stream busy"
    for r, published in zip(requests, pending.result()):
        want = destination_lists(batch.dsts[0], r.row, 0, r.prompt_len)
        assert (published.lists.pages == want.pages).all()


def test_the_eager_convenience_call_does_not_wait_either():
    batch = on_device(build_batch(PRESETS["llama70b-tp8-p64"].scaled(layers=2), requests=2, prompt_len=[300, 129]),
                      torch.device("cuda"))
    eager.plan(batch).descriptors()
    took, pending = _returns_while_busy(lambda: eager.plan(batch))
    assert took < SLEEP_S / 4 and not pending.ready()
    pending.descriptors()
