"""Replaying the GPU planner's device work from a CUDA graph.

A serving loop plans batches of the same shape over and over: the same number of transfers,
chunks and components, the same lengths. For those, :class:`GraphPlanner` captures the whole
device side of :func:`kvplan.planner.gpu.plan` once: the metadata copy, every kernel and the
copy of the small results to the host. Each later plan then costs the host layout, one memcpy
into a pinned buffer and one graph replay, instead of some 30 launches. A batch of another shape,
or with another token table or slot map, is captured anew. The first plan of a shape runs
eagerly: it compiles the kernels, which a capture must not do.

The plans it returns are the eager planner's, bit for bit (a test on the GPU checks it). Like
any graph's outputs, a replayed plan's buffers are reused by the next plan of the same shape:
consume a plan (``descriptors()``, ``result()``) before planning the next batch of its shape;
the planner waits for the previous replay before it overwrites its inputs.

Example::

    planner = GraphPlanner()
    for batch in batches:                   # same shape each step, new contents
        descs, offsets = planner.plan(batch).descriptors()
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import InputError
from .gpu import PendingPlan, _Job, _launch, plan_inputs
from .model import Batch

__all__ = ["GraphPlanner"]


class GraphPlanner:
    """Plans batches on a CUDA device, replaying a captured graph while the batch shape repeats."""

    def __init__(self, block: int = 1024, max_graphs: int = 8):
        self.block, self.max_graphs = block, max_graphs
        self._graphs: dict[tuple, _Captured] = {}
        self._seen: set[tuple] = set()
        self.replays = 0

    def plan(self, batch: Batch) -> PendingPlan:
        table, maps, layout, slots, device = plan_inputs(batch, prepared=False)
        if device.type != "cuda":
            raise InputError(None, "CUDA graphs need the token table on a CUDA device")
        job = _Job(layout, maps, self.block, slots)
        key = job.key(table)
        stream = torch.cuda.current_stream(device)
        captured = self._graphs.get(key)
        if captured is None:
            if key not in self._seen:  # first sight of this shape: run eagerly (this compiles the kernels)
                self._seen.add(key)
                return _launch(batch, layout, table, maps, device, self.block, stream, slots)
            if len(self._graphs) >= self.max_graphs:
                self._graphs.pop(next(iter(self._graphs)))
            captured = self._graphs[key] = _Captured(job, table, device)
        captured.replay(job, stream)
        self.replays += 1
        event = torch.cuda.Event()
        event.record(stream)
        return PendingPlan(event, batch, layout, captured.host, captured.device_results, [captured], None)


class _Captured:
    """One captured run: static pinned input, device buffer, landing buffers and the graph."""

    def __init__(self, job: _Job, table: torch.Tensor, device: torch.device):
        self.staging = torch.empty(max(1, job.packer.size), dtype=torch.int64, pin_memory=True)
        job.packer.device_buffer = torch.empty(max(1, job.packer.size), dtype=torch.int64, device=device)
        self.device_buffer = job.packer.device_buffer
        self.landing = job.landing(device)
        self.graph = torch.cuda.CUDAGraph()
        self.done: torch.cuda.Event | None = None
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            with torch.cuda.graph(self.graph, stream=side):
                self.device_buffer.copy_(self.staging, non_blocking=True)
                self.host, self.device_results, self._keep = job.run(table, self.landing)
        torch.cuda.current_stream(device).wait_stream(side)

    def replay(self, job: _Job, stream: torch.cuda.Stream) -> None:
        if self.done is not None:
            self.done.synchronize()  # the previous replay may still read the pinned input
        if job.packer.size:
            np.concatenate(job.packer.parts, out=self.staging.numpy()[: job.packer.size])
        with torch.cuda.stream(stream):
            self.graph.replay()
            self.done = torch.cuda.Event()
            self.done.record(stream)
