"""Recurring copies kept as CUDA graphs (kvplan/transport/copy_graphs.py): a kept graph copies what
its buffers hold when it is replayed, counted on the device; a capture that fails turns the graphs
off and the copies are launched instead; kvplan's own errors are never taken for a failed capture;
a graph uploaded ahead copies what it would have copied without."""

import pytest
import torch

from kvplan.errors import InputError
from kvplan.transport.copy_graphs import CopyGraphs, capture_copy, upload_graph
from kvplan.transport.local import scatter


class _FailingGraph:
    def capture_begin(self, **kwargs):
        raise RuntimeError("capture not permitted here")

    def capture_end(self):
        pass


def test_a_capture_that_fails_turns_the_graphs_off_and_launches(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FailingGraph)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: __import__("contextlib").nullcontext())
    graphs, launched = CopyGraphs(capture_stream=None), []
    graphs.run("k", lambda: launched.append(1))
    graphs.run("k", lambda: launched.append(2))
    assert launched == [1, 2] and not graphs.enabled and graphs.replays == 0


def test_kvplan_errors_inside_a_capture_propagate(monkeypatch):
    class _Graph(_FailingGraph):
        def capture_begin(self, **kwargs):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: __import__("contextlib").nullcontext())
    graphs = CopyGraphs(capture_stream=None)

    def bad() -> None:
        raise InputError("r1", "the staging buffer is too small")

    with pytest.raises(InputError):
        graphs.run("k", bad)
    assert graphs.enabled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_kept_graph_copies_what_its_buffers_hold_when_replayed():
    """One counted scatter over buffers of 64 rows, kept under one key, run for two batches: each
    replay lands the rows the buffers then hold, as many as the device count says; the rows past it
    point at a guard that stays zero."""
    dev = torch.device("cuda")
    staging = torch.randint(0, 256, (1 << 14,), dtype=torch.uint8, device=dev)
    dst, guard = torch.zeros(1 << 14, dtype=torch.uint8, device=dev), torch.zeros(1024, dtype=torch.uint8, device=dev)
    descs = torch.zeros((64, 3), dtype=torch.int64, device=dev)
    offsets = torch.zeros(64, dtype=torch.int64, device=dev)
    rows = torch.zeros(1, dtype=torch.int64, device=dev)
    graphs = CopyGraphs(torch.cuda.Stream(dev))
    for sizes in ([256] * 5, [512, 128, 64]):
        dst.zero_()
        n, places = len(sizes), [4096 - 1024 * k for k in range(len(sizes))]  # written back to front
        starts = torch.tensor([0] + sizes[:-1]).cumsum(0).tolist()
        descs[:] = torch.tensor([0, guard.data_ptr(), 1024])
        descs[:n] = torch.tensor([[0, dst.data_ptr() + p, s] for p, s in zip(places, sizes)])
        offsets[:] = 0
        offsets[:n] = torch.tensor(starts)
        rows.fill_(n)
        graphs.run(("scatter", 16), lambda: scatter(descs, offsets, staging, 16, 4096, need=sum(sizes), rows=rows))
        torch.cuda.synchronize()
        expected = torch.zeros_like(dst)
        for p, s, o in zip(places, sizes, starts):
            expected[p : p + s] = staging[o : o + s]
        assert torch.equal(dst, expected) and not guard.any()
    assert graphs.replays == 2


def test_a_graph_torch_does_not_expose_is_not_uploaded_and_nothing_fails():
    class _Opaque:  # an older torch: no raw_cuda_graph_exec
        pass

    assert upload_graph(_Opaque(), None) is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_an_uploaded_scatter_graph_lands_what_the_staging_holds_when_replayed():
    """A scatter captured (not run), uploaded for the stream it is replayed on, then fed new staging
    bytes: its one replay lands those bytes on scattered pages, and nothing before it did."""
    dev = torch.device("cuda")
    pages, page = 64, 4096
    staging = torch.zeros(pages * page, dtype=torch.uint8, device=dev)
    pool = torch.zeros(2 * pages * page, dtype=torch.uint8, device=dev)
    order = torch.randperm(2 * pages, device=dev)[:pages]
    descs = torch.stack([torch.zeros_like(order), pool.data_ptr() + order * page, torch.full_like(order, page)], 1)
    offsets = torch.arange(pages, device=dev, dtype=torch.int64) * page
    capture_stream, stream = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    scatter(descs, offsets, staging, 16, page, need=staging.numel())  # compiled outside the capture
    graph = capture_copy(lambda: scatter(descs, offsets, staging, 16, page, need=staging.numel()), capture_stream,
                         "scatters")
    assert graph is not None
    uploaded = upload_graph(graph, stream)
    assert uploaded == hasattr(graph, "raw_cuda_graph_exec")
    stream.synchronize()
    assert not pool.any()  # captured and uploaded: nothing copied yet
    staging.copy_(torch.randint(0, 256, staging.shape, dtype=torch.uint8, device=dev))
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        graph.replay()
    stream.synchronize()
    expected = torch.zeros_like(pool).view(2 * pages, page)
    expected[order] = staging.view(pages, page)
    assert torch.equal(pool.view(2 * pages, page), expected)
