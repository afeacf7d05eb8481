"""Copy launches kept as CUDA graphs, replayed where the same copy recurs from batch to batch.

A Triton launch costs the host 25-35 us in a tight loop, and 100-200 us between the other steps of
the two-process demo (benchmarks/RESULTS.md, session 15). A staged batch has two on its critical
path: the sender's gather behind its plan (:mod:`.ahead`) and the receiver's scatter of a landed
wave. Both read buffers that recur: a planner's buffers of one bucket slot, at full capacity and
counted on the device by the plan's live rows, and the staging buffer. Captured once per buffer
set and launch shape (:func:`~kvplan.kernels.copy.launch_shape`), such a copy is then one graph
replay. A capture that fails turns the graphs off: the copies are then launched as before.

Example::

    graphs = CopyGraphs(transport_stream(device))
    key = ("scatter", descs.data_ptr(), launch_shape(typical, alignment), shift)
    graphs.run(key, lambda: scatter(descs, offsets, staging, alignment, typical, need, shift, rows=rows))
"""

from __future__ import annotations

import ctypes
import logging
from collections import OrderedDict
from typing import Callable, Hashable

import torch

from .. import env
from ..errors import KvplanError

__all__ = ["CopyGraphs", "capture_copy", "copy_graphs_enabled", "upload_graph"]

log = logging.getLogger(__name__)


def capture_copy(launch: Callable[[], None], stream: torch.cuda.Stream, what: str) -> torch.cuda.CUDAGraph | None:
    """``launch``'s kernels captured as a graph on ``stream`` (not run), or ``None`` where the capture
    fails, with a warning that ``what`` are launched instead (a kernel compiled for the first time
    inside a capture, say). kvplan's own errors are not capture failures: they propagate."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                launch()
            finally:
                graph.capture_end()
    except KvplanError:
        raise
    except Exception as err:  # noqa: BLE001 - any other failure of the capture means: launch instead
        log.warning("%s are launched, not replayed: a capture failed (%s: %s)", what, type(err).__name__, err)
        return None
    return graph


def upload_graph(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> bool:
    """Upload a captured graph's executable to the device for launches on ``stream``
    (``cuGraphUpload``), so that its first replay does not pay for it. Whether it was uploaded:
    ``False`` where torch does not expose the executable or the driver refuses (the first replay
    then uploads it, as it would anyway)."""
    global _driver
    raw = getattr(graph, "raw_cuda_graph_exec", None)
    if raw is None:
        return False
    try:
        if _driver is None:
            _driver = ctypes.CDLL("libcuda.so.1")
        status = _driver.cuGraphUpload(ctypes.c_void_p(raw()), ctypes.c_void_p(stream.cuda_stream))
    except (OSError, AttributeError, RuntimeError) as err:
        log.debug("a graph could not be uploaded ahead: %s", err)
        return False
    return status == 0


_driver: ctypes.CDLL | None = None


def copy_graphs_enabled() -> bool:
    """Whether recurring copies replay graphs (``KVPLAN_COPY_GRAPHS``, default on; ``0`` turns them off)."""
    return env.enabled("KVPLAN_COPY_GRAPHS")


class CopyGraphs:
    """Graphs of recurring copies, by key, captured on ``capture_stream``; at most ``limit`` kept
    (the least recently used goes first). ``replays`` counts the copies run as graphs."""

    def __init__(self, capture_stream: torch.cuda.Stream, limit: int = 16):
        self.capture_stream, self.limit = capture_stream, limit
        self._graphs: OrderedDict[Hashable, torch.cuda.CUDAGraph] = OrderedDict()
        self.enabled = True
        self.replays = 0

    def run(self, key: Hashable, launch: Callable[[], None]) -> None:
        """Run ``launch``'s copy on the current stream: as the graph kept under ``key`` (captured from
        ``launch`` on first use), or by calling ``launch`` where a capture has failed. The key must
        name everything the copy reads and its launch shape: a replay repeats the captured launch."""
        graph = self._graphs.get(key) if self.enabled else None
        if graph is None and self.enabled:
            graph = capture_copy(launch, self.capture_stream, "recurring copies")
            self.enabled = graph is not None
            if graph is not None:
                self._graphs[key] = graph
                while len(self._graphs) > self.limit:
                    self._graphs.popitem(last=False)
        if graph is None:
            launch()
            return
        self._graphs.move_to_end(key)
        graph.replay()
        self.replays += 1
