"""How far the forward pass has written, as the sender sees it: a word in pinned host memory.

The forward pass calls :meth:`LayerReadiness.mark` after the kernels that write layer group ``g``.
That enqueues, on the forward pass's stream, a 4-byte copy of the constant ``g + 1`` into a pinned
host word (as the device maps it): it runs after those kernels (stream order), costs the caller no
host sync, and is captured by a CUDA graph like any other copy (the constants live in a device
tensor made once, so a replay copies the same values). The sender reads :meth:`ready` without touching CUDA:
a load from pinned memory. docs/layerwise.md §2 says what it costs the forward pass.

A mark made eagerly (not while a CUDA graph is captured) also records a CUDA event of its group
(:meth:`LayerReadiness.written`). A staged sender makes its stream wait for that event and queues
the group's gathers ahead: they run on the device the moment the group is written, with no host
step between the mark and the first byte gathered. Under a captured graph there is no such event,
and the sender gathers once it reads the word.

Example::

    readiness = LayerReadiness(groups=4, device="cuda")
    for g, layers in enumerate(groups_of_layers):
        run_layers(layers)                  # writes the KV pages of these layers
        readiness.mark(g)                   # no sync: a copy queued behind them
    ...                                     # meanwhile send(..., layers=LayerStreaming(groups, readiness, tables_written))
    readiness.reset()                       # before the next forward pass marks again
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import LayoutError
from ..planner.contract.layer_groups import LayerGroups

__all__ = ["LayerReadiness", "LayerStreaming", "Readiness"]


class Readiness(Protocol):
    """Anything that says how many layer groups have been written. It may also have
    ``written(group)``, returning an event recorded once that group is written, or ``None``
    (:meth:`LayerReadiness.written`): a staged sender then gathers the group ahead of the mark."""

    def ready(self) -> int: ...


class _Mapped:
    """A pinned host word as the device addresses it (unified addressing: the same pointer)."""

    def __init__(self, word: torch.Tensor):
        self.__cuda_array_interface__ = {"shape": (1,), "typestr": "<i4", "data": (word.data_ptr(), False),
                                         "version": 3}


class LayerReadiness:
    """A counter of layer groups written, set on the device's stream and read on the host.

    ``via``: how a mark reaches the word: ``"mapped"`` (the default on a GPU) is a device-to-device
    copy into the pinned word as the device maps it; ``"copy"`` a device-to-host copy into it.
    """

    def __init__(self, groups: int, device: str | torch.device = "cuda", via: str = "mapped"):
        if groups < 1:
            raise LayoutError(f"a readiness signal needs at least one group, got {groups}")
        if via not in ("mapped", "copy"):
            raise ValueError(f"via must be 'mapped' or 'copy', got {via!r}")
        self.groups = groups
        self.device = torch.device(device)
        self._marks = torch.arange(1, groups + 1, dtype=torch.int32, device=self.device)
        cuda = self.device.type == "cuda"
        self._word = torch.zeros(1, dtype=torch.int32, pin_memory=cuda)
        self._view = self._word.numpy()
        self._target = self._word
        if cuda and via == "mapped":
            self._target = torch.as_tensor(_Mapped(self._word), device=self.device)
        self._events = [torch.cuda.Event() for _ in range(groups)] if cuda else []
        self._recorded = 0  # groups whose event this pass has recorded (host side, eager marks only)

    def mark(self, group: int) -> None:
        """Say, on the current stream, that every group up to ``group`` is written."""
        if not 0 <= group < self.groups:
            raise LayoutError(f"layer group {group} is outside the {self.groups} groups")
        self._target.copy_(self._marks[group : group + 1], non_blocking=True)
        if self._events and not torch.cuda.is_current_stream_capturing():
            self._events[group].record()
            self._recorded = max(self._recorded, group + 1)

    def written(self, group: int) -> Any:
        """The CUDA event this pass recorded once ``group`` was written, or ``None`` where there is
        none to wait for (the mark is not queued yet, was captured in a graph, or on the CPU).
        Waiting on it is safe: it was recorded by this pass, after the group's kernels."""
        return self._events[group] if group < self._recorded else None

    def ready(self) -> int:
        """How many groups are written (a read of pinned memory; never syncs)."""
        return int(self._view[0])

    def reset(self) -> None:
        """Back to zero groups written: call once the last send of the previous pass has returned."""
        self._view[0] = 0
        self._recorded = 0


@dataclass(frozen=True)
class LayerStreaming:
    """What :meth:`PrefillEndpoint.send` needs to post a batch layer group by layer group: the
    groups, the signal that says how many of them the forward pass has written and, on a GPU,
    ``inputs_ready``: a CUDA event recorded once the batch's token table and slot maps were
    written, before the forward pass was queued. The plan waits for that event and nothing else.
    Without it the plan waits for everything queued on the current stream at the call, which is
    the whole forward pass when that shares the stream (or runs on a torch side stream while the
    current stream is the legacy default one): then nothing streams."""

    groups: LayerGroups
    readiness: Readiness
    inputs_ready: Any = None

    def __post_init__(self) -> None:
        count = getattr(self.readiness, "groups", self.groups.count)
        if count != self.groups.count:
            raise LayoutError(f"the readiness signal counts {count} groups, the layer groups are {self.groups.count}")
