"""A plan's sections split by layer group, for streaming KV while the prefill still computes.

A batch is planned once (its descriptors do not change). Every section's descriptors are
entry-major (planning.md §5), so the rows of one entry are one contiguous range, and the rows of
the layers of a group are a few ranges: MHA's K and V halves, a component's entries. Each
:class:`GroupSection` names those ranges and the model-wide layers its notification covers; the
receiver counts layers (docs/layerwise.md §3). Aux, and a component that declares no layers, go
with the last group.

Example::

    groups = LayerGroups.even(num_layers=80, groups=4)            # layers [0,20), [20,40), ...
    groups = LayerGroups.tapered(num_layers=80, groups=8)         # ..., [66,74), [74,78), [78,80): little left to expose
    per_group = group_sections(plan.sections(), [pair_sides(src, dst)], src, [0] * len(plan.transfers), groups)
    for g, sections in enumerate(per_group):
        ...  # once layer group g is written, post descs[s.rows()] for each s in sections
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ...errors import LayoutError
from .batch import SideMemory
from .pairing import SidePairing
from .plan import AUX_ROLE, KV_ROLE, Section

__all__ = ["GroupSection", "LayerGroups", "group_sections"]


@dataclass(frozen=True)
class LayerGroups:
    """Model layers in groups, posted in order: group ``g`` is layers ``[bounds[g], bounds[g + 1])``.

    Example::

        LayerGroups((0, 3, 6, 8)).group_of(np.array([0, 5, 7]))    # [0, 1, 2]
    """

    bounds: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "bounds", tuple(int(b) for b in self.bounds))
        if len(self.bounds) < 2 or any(b <= a for a, b in zip(self.bounds, self.bounds[1:])):
            raise LayoutError(f"layer group bounds must be at least two increasing layer ids, got {self.bounds}")

    @classmethod
    def even(cls, num_layers: int, groups: int, first_layer: int = 0) -> "LayerGroups":
        """``groups`` groups of as equal a size as can be over ``[first_layer, first_layer + num_layers)``."""
        if not 1 <= groups <= num_layers:
            raise LayoutError(f"cannot split {num_layers} layers into {groups} groups")
        return cls(tuple(first_layer + (num_layers * g) // groups for g in range(groups + 1)))

    @classmethod
    def tapered(cls, num_layers: int, groups: int, first_layer: int = 0, last: int = 2) -> "LayerGroups":
        """``groups`` groups whose last ones shrink by halves down to ``last`` layers, the rest even.

        Streaming leaves only the last group (and aux) to move after the forward pass ends
        (docs/layerwise.md §4), so a small last group exposes little. From the end, the groups
        take ``last``, ``2 * last``, ``4 * last``, ... layers while each is at most an even share of
        the layers still left; the first groups split what remains as :meth:`even` does.

        Each group must have moved by the time the pass ends. A group's gather runs on the GPU
        once its layers are written, but a forward pass's matmul that already fills every SM holds
        it back until that matmul ends (measured: docs/layerwise.md §5): the group before the last
        is gathered one layer after its mark. ``last=2`` leaves it a layer's time to move;
        ``last=1`` suits a pass whose kernels leave room between them.

        Example::

            LayerGroups.tapered(80, 8).bounds          # sizes 13, 13, 13, 13, 14, 8, 4, 2
            LayerGroups.tapered(80, 8, last=1).bounds  # sizes 16, 16, 17, 16, 8, 4, 2, 1
        """
        if not 1 <= groups <= num_layers:
            raise LayoutError(f"cannot split {num_layers} layers into {groups} groups")
        if last < 1:
            raise LayoutError(f"the last layer group must hold at least one layer, got {last}")
        tail: list[int] = []  # the last groups' sizes, last first
        layers_left, groups_left = num_layers, groups
        while groups_left > 1 and (size := last << len(tail)) * groups_left <= layers_left:
            tail.append(size)
            layers_left -= size
            groups_left -= 1
        head = cls.even(layers_left, groups_left, first_layer).bounds
        return cls(head + tuple(head[-1] + int(b) for b in np.cumsum(tail[::-1])))

    @property
    def count(self) -> int:
        return len(self.bounds) - 1

    @property
    def sizes(self) -> list[int]:
        """Each group's number of layers."""
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]

    def group_of(self, layers: np.ndarray, what: str = "layer") -> np.ndarray:
        """The group of each layer id; LayoutError for one outside every group."""
        layers = np.asarray(layers, np.int64)
        outside = (layers < self.bounds[0]) | (layers >= self.bounds[-1])
        if outside.any():
            raise LayoutError(f"{what} {int(layers[outside][0])} is outside the layer groups "
                              f"[{self.bounds[0]}, {self.bounds[-1]})")
        return np.searchsorted(np.asarray(self.bounds), layers, side="right") - 1


@dataclass(frozen=True)
class GroupSection:
    """The part of a :class:`~kvplan.planner.contract.plan.Section` that one layer group carries.

    ``spans`` are ``[lo, hi)`` ranges of :meth:`Plan.descriptors`; ``layers`` is the model-wide
    layer range the receiver counts it for (``None``: every layer, for aux and components that
    declare no layers); ``count`` is the section's (pages for KV, else 1).
    """

    transfer: int
    request: Any
    role: int
    name: str
    count: int
    group: int
    layers: tuple[int, int] | None
    spans: tuple[tuple[int, int], ...]

    def rows(self) -> np.ndarray:
        """The indices of this part's descriptors."""
        return np.concatenate([np.arange(lo, hi) for lo, hi in self.spans])

    @property
    def num_descs(self) -> int:
        return sum(hi - lo for lo, hi in self.spans)


def _row_layers(src: SideMemory, pairing: SidePairing, role: int) -> np.ndarray | None:
    """The model-wide layer of each row of a role's entry tables (``None``: the role is not layered)."""
    if role == KV_ROLE:
        layers = np.asarray(src.kv.model_layers, np.int64)
        return np.tile(layers, len(pairing.kv_src) // max(1, len(layers)))
    if role == AUX_ROLE or not src.state[role].layers:
        return None
    return np.asarray(src.state[role].layers, np.int64)[pairing.component_rows(role)]


def _spans(lo: int, per_row: int, rows: np.ndarray) -> tuple[tuple[int, int], ...]:
    """``[lo, hi)`` descriptor ranges of ascending table rows, consecutive rows merged."""
    stretches = np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1)
    return tuple((lo + int(r[0]) * per_row, lo + (int(r[-1]) + 1) * per_row) for r in stretches)


def group_sections(sections: Sequence[Section], pairings: Sequence[SidePairing], src: SideMemory,
                   dests: Sequence[int], groups: LayerGroups) -> list[list[GroupSection]]:
    """Split a plan's sections by layer group: one list per group, in group order.

    ``pairings[d]`` pairs ``src`` with destination ``d``; ``dests[t]`` is transfer ``t``'s
    destination. Every descriptor of every section lands in exactly one group.
    """
    out: list[list[GroupSection]] = [[] for _ in range(groups.count)]
    layer_cache: dict[tuple[int, int], np.ndarray | None] = {}
    last = groups.count - 1
    for s in sections:
        dest = dests[s.transfer]
        key = (dest, s.role)
        if key not in layer_cache:
            layer_cache[key] = _row_layers(src, pairings[dest], s.role)
        layers = layer_cache[key]
        if layers is None:
            out[last].append(GroupSection(s.transfer, s.request, s.role, s.name, s.count, last, None, ((s.lo, s.hi),)))
            continue
        if (s.hi - s.lo) % max(1, len(layers)):
            raise LayoutError(f"{s.name} of {s.request!r}: {s.hi - s.lo} descriptors do not split into "
                              f"{len(layers)} entries")
        per_row = (s.hi - s.lo) // len(layers)
        owner = groups.group_of(layers, f"{s.name} layer")
        for g in np.unique(owner).tolist():
            rows = np.flatnonzero(owner == g)
            covered = layers[rows]
            out[g].append(GroupSection(s.transfer, s.request, s.role, s.name, s.count, g,
                                       (int(covered.min()), int(covered.max()) + 1), _spans(s.lo, per_row, rows)))
    return out
