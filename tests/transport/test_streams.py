"""The transport's own CUDA streams (GPU only): non-blocking, and able to wait on the device for a
layer group's readiness mark (docs/layerwise.md §2)."""

import time

import pytest
import torch

from kvplan.transport.readiness import LayerReadiness
from kvplan.transport.streams import transport_stream, wait_word

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def queued_behind_mark(readiness: LayerReadiness, group: int):
    """A copy queued on a transport stream behind a device-side wait for ``group``'s mark, and its event."""
    stream = transport_stream(torch.device("cuda", 0))
    src = torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    torch.cuda.synchronize()
    assert wait_word(stream, readiness.word_address, group + 1)
    with torch.cuda.stream(stream):
        dst.copy_(src)
        done = torch.cuda.Event()
        done.record(stream)
    return dst, done


def settles(event, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_work_queued_behind_a_mark_runs_only_once_the_forward_pass_marks_it():
    readiness = LayerReadiness(3, "cuda")
    dst, done = queued_behind_mark(readiness, 1)
    readiness.mark(0)  # an earlier group is not enough
    torch.cuda.current_stream().synchronize()
    assert not settles(done, 0.2) and int(dst.sum()) == 0
    readiness.mark(1)
    assert settles(done, 5.0)
    assert int(dst[0]) == 7 and int(dst[-1]) == 7


def test_release_lets_a_wait_for_a_group_that_is_never_marked_through():
    readiness = LayerReadiness(2, "cuda")
    _, done = queued_behind_mark(readiness, 1)
    assert not settles(done, 0.1)
    readiness.release()
    assert settles(done, 5.0)
    readiness.reset()
    assert readiness.ready() == 0
