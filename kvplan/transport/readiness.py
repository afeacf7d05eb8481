"""How far the forward pass has written, as the sender sees it: a word in pinned host memory.

The forward pass calls :meth:`LayerReadiness.mark` after the kernels that write layer group ``g``.
That enqueues, on the forward pass's stream, a 4-byte device-to-host copy of the constant ``g + 1``
into a pinned word: it runs after those kernels (stream order), costs the caller no host sync,
and is captured by a CUDA graph like any other copy (the constants live in a device tensor made
once, so a replay copies the same values). The sender reads :meth:`ready` without touching CUDA:
a load from pinned memory. docs/layerwise.md §2 says what it costs the forward pass.

Example::

    readiness = LayerReadiness(groups=4, device="cuda")
    for g, layers in enumerate(groups_of_layers):
        run_layers(layers)                  # writes the KV pages of these layers
        readiness.mark(g)                   # no sync: a copy queued behind them
    ...                                     # meanwhile PrefillEndpoint.send(..., layers=LayerStreaming(...))
    readiness.reset()                       # before the next forward pass marks again
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import LayoutError
from ..planner.layer_groups import LayerGroups

__all__ = ["LayerReadiness", "LayerStreaming", "Readiness"]


class Readiness(Protocol):
    """Anything that says how many layer groups have been written."""

    def ready(self) -> int: ...


class LayerReadiness:
    """A counter of layer groups written, set on the device's stream and read on the host."""

    def __init__(self, groups: int, device: str | torch.device = "cuda"):
        if groups < 1:
            raise LayoutError(f"a readiness signal needs at least one group, got {groups}")
        self.groups = groups
        self.device = torch.device(device)
        self._marks = torch.arange(1, groups + 1, dtype=torch.int32, device=self.device)
        self._word = torch.zeros(1, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self._view = self._word.numpy()

    def mark(self, group: int) -> None:
        """Say, on the current stream, that every group up to ``group`` is written."""
        if not 0 <= group < self.groups:
            raise LayoutError(f"layer group {group} is outside the {self.groups} groups")
        self._word.copy_(self._marks[group : group + 1], non_blocking=True)

    def ready(self) -> int:
        """How many groups are written (a read of pinned memory; never syncs)."""
        return int(self._view[0])

    def reset(self) -> None:
        """Back to zero groups written: call once the last send of the previous pass has returned."""
        self._view[0] = 0


@dataclass(frozen=True)
class LayerStreaming:
    """What :meth:`PrefillEndpoint.send` needs to post a batch layer group by layer group: the
    groups and the signal that says how many of them the forward pass has written."""

    groups: LayerGroups
    readiness: Readiness

    def __post_init__(self) -> None:
        count = getattr(self.readiness, "groups", self.groups.count)
        if count != self.groups.count:
            raise LayoutError(f"the readiness signal counts {count} groups, the layer groups are {self.groups.count}")
