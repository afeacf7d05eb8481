"""A stand-in for a prefill's forward pass, for streaming in layer groups (docs/layerwise.md §4).

Per layer: a ``[tokens, dim] x [dim, dim]`` matmul (``2 * tokens * dim**2`` FLOPs, sized like the
model's layer), then that layer's KV and state bytes written into the pool; after each layer group,
:meth:`LayerReadiness.mark`. The pool starts zeroed (:meth:`StandInForward.clear`), so a sender
that posted a group before it was written would move zeros, and the decode's byte check would fail.
Aux rows and components that declare no layers are written with the last group.

Example::

    forward = StandInForward(side, tensors, LayerGroups.even(80, 4), dim=10240, tokens=8192)
    forward.clear()
    forward.start()                            # a thread enqueues the layers on their own stream
    endpoint.send(transfers, layers=forward.streaming())
    started, ended = forward.join(timeout=60)  # monotonic seconds: the forward pass's span
"""

from __future__ import annotations

import threading
import time

import torch

from ..errors import KvplanError
from ..planner.contract.layer_groups import LayerGroups
from ..planner.contract.batch import SideMemory
from ..transport.readiness import LayerReadiness, LayerStreaming

__all__ = ["StandInForward", "entry_layers"]


def entry_layers(side: SideMemory) -> list[int | None]:
    """The model-wide layer of every entry, in :func:`~kvplan.tools.scenarios.materialize`'s tensor
    order (KV, each component's, aux); ``None`` for aux and components that declare no layers."""
    kv = list(side.kv.model_layers) * (len(side.kv.entries) // max(1, side.kv.num_layers))
    state = [c.layers[i] if c.layers else None for c in side.state for i in range(len(c.entries))]
    return kv + state + [None] * len(side.aux)


class StandInForward:
    """A forward pass that writes ``tensors`` (the side's entries) layer by layer (see the module)."""

    def __init__(self, side: SideMemory, tensors: list[torch.Tensor], groups: LayerGroups, dim: int = 0,
                 tokens: int = 1, marks: bool = True):
        self.groups, self.tensors, self.dim, self.marks = groups, tensors, dim, marks
        self.layer_of = entry_layers(side)
        self.truth = [t.clone() for t in tensors]
        self.device = tensors[0].device if tensors else torch.device("cpu")
        self.readiness = LayerReadiness(groups.count, self.device)
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        dtype = torch.bfloat16 if cuda else torch.float32
        gen = torch.Generator(device=self.device).manual_seed(0)
        self.x = torch.randn(tokens, dim, dtype=dtype, device=self.device, generator=gen) if dim else None
        self.w = torch.randn(dim, dim, dtype=dtype, device=self.device, generator=gen) / dim ** 0.5 if dim else None
        self._thread: threading.Thread | None = None
        self._span: tuple[float, float] | None = None
        self._error: BaseException | None = None

    def streaming(self) -> LayerStreaming:
        """What :meth:`PrefillEndpoint.send` takes to stream behind this pass (call before
        :meth:`start`: its ``inputs_ready`` is recorded now, ahead of the pass's kernels)."""
        inputs_ready = None
        if self.stream is not None:
            inputs_ready = torch.cuda.Event()
            inputs_ready.record()
        return LayerStreaming(self.groups, self.readiness, inputs_ready)

    def clear(self) -> None:
        """Zero the pool and the readiness word (before a pass; synchronous)."""
        for t in self.tensors:
            t.zero_()
        if self.stream is not None:
            torch.cuda.synchronize(self.device)
        self.readiness.reset()

    def run(self) -> None:
        """Enqueue the whole pass on this pass's stream (on the CPU: run it)."""
        last = self.groups.count - 1
        for g in range(self.groups.count):
            for layer in range(self.groups.bounds[g], self.groups.bounds[g + 1]):
                if self.dim:
                    torch.mm(self.x, self.w)
                self._write(lambda of: of == layer)
            if g == last:
                self._write(lambda of: of is None or not self.groups.bounds[0] <= of < self.groups.bounds[-1])
            if self.marks:
                self.readiness.mark(g)

    def _write(self, chosen) -> None:
        for t, truth, of in zip(self.tensors, self.truth, self.layer_of):
            if chosen(of):
                t.copy_(truth, non_blocking=True)

    def start(self) -> None:
        """Run the pass on a thread of its own (so that a sender can stream meanwhile)."""
        self._span, self._error = None, None
        self._thread = threading.Thread(target=self._main, name="stand-in-forward", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            started = time.monotonic()
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    self.run()
                self.stream.synchronize()
            else:
                self.run()
            self._span = (started, time.monotonic())
        except BaseException as err:  # noqa: BLE001 - raised again by join()
            self._error = err

    def join(self, timeout: float) -> tuple[float, float]:
        """Wait for the pass; its ``(started, ended)`` monotonic seconds."""
        if self._thread is None:
            raise KvplanError("the stand-in forward pass was not started")
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise KvplanError(f"the stand-in forward pass did not end within {timeout} s")
        if self._error is not None:
            raise KvplanError(f"the stand-in forward pass failed: {self._error}") from self._error
        assert self._span is not None
        return self._span
