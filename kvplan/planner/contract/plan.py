"""What a planner returns: per transfer, its page lists, runs, state lists and descriptors.

The NumPy reference and the GPU planner both return a :class:`Plan`; two plans are equal when
every field of every transfer is equal (:meth:`Plan.assert_equal` says where they differ).
Descriptors are ``[n, 3]`` uint64 arrays of ``(src_addr, dst_addr, nbytes)`` in the order
planning.md §5 fixes: KV (entry-major, then runs), then each state component in order, then aux.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

import numpy as np

from .batch import StateKind
from .pairing import Mode

__all__ = ["ComponentPlan", "DestinationLists", "Plan", "Role", "Section", "TransferPlan", "empty_descs", "empty_runs"]

class Role(enum.IntEnum):
    """What a section or list carries besides a state component (a component's role is its index, >= 0)."""

    KV = -1
    AUX = -2


KV_ROLE, AUX_ROLE = Role.KV, Role.AUX


def empty_descs() -> np.ndarray:
    return np.zeros((0, 3), dtype=np.uint64)


def empty_runs() -> np.ndarray:
    return np.zeros((0, 3), dtype=np.int64)


@dataclass(frozen=True)
class DestinationLists:
    """What a decode side publishes for one request: pages for ``[P, L)`` and state lists over ``L``."""

    pages: np.ndarray
    state: tuple[np.ndarray, ...]


@dataclass(frozen=True)
class ComponentPlan:
    """One state component of a last chunk: both index lists, their runs, its descriptors."""

    name: str
    kind: StateKind
    src_list: np.ndarray
    dst_list: np.ndarray
    runs: np.ndarray
    descs: np.ndarray


@dataclass(frozen=True)
class TransferPlan:
    """The plan of one transfer (one chunk of one request to one destination).

    ``sent`` is False for a non-last chunk with no pages (planning.md §3): it has no descriptors.
    ``runs`` are ``(s0, d0, len)`` rows over ``src_pages``/``dst_pages``.
    """

    request: object
    dest: int
    mode: Mode
    start: int
    end: int
    last: bool
    sent: bool
    src_pages: np.ndarray
    dst_pages: np.ndarray
    runs: np.ndarray
    kv_descs: np.ndarray
    state: tuple[ComponentPlan, ...]
    aux_descs: np.ndarray

    @property
    def descs(self) -> np.ndarray:
        """All descriptors of this transfer: KV, then state components, then aux."""
        return np.concatenate([self.kv_descs, *(c.descs for c in self.state), self.aux_descs])

    @property
    def num_descs(self) -> int:
        return len(self.kv_descs) + sum(len(c.descs) for c in self.state) + len(self.aux_descs)

    @property
    def expected_components(self) -> tuple[str, ...]:
        """The components the receiver must wait for: those with a non-empty list (§6)."""
        return tuple(c.name for c in self.state if len(c.dst_list))


@dataclass(frozen=True)
class Section:
    """A contiguous range of a plan's descriptors that the receiver tracks as one unit.

    ``role`` is -1 (KV), -2 (aux) or a component index; ``count`` is the number of destination
    pages for KV and 1 otherwise; ``lo``/``hi`` index :meth:`Plan.descriptors`. ``layers``: the
    model-wide layers ``[lo, hi)`` it covers when it is one layer group's part (docs/layerwise.md),
    ``None`` for every layer.
    """

    transfer: int
    request: object
    role: int
    name: str
    lo: int
    hi: int
    count: int
    layers: tuple[int, int] | None = None


@dataclass(frozen=True)
class Plan:
    """A batch's plan: one :class:`TransferPlan` per transfer, in batch order."""

    transfers: tuple[TransferPlan, ...]

    @property
    def num_descs(self) -> int:
        return sum(t.num_descs for t in self.transfers)

    def descriptors(self) -> tuple[np.ndarray, np.ndarray]:
        """All descriptors as one ``[n, 3]`` uint64 array and per-transfer offsets ``[T + 1]``."""
        counts = [t.num_descs for t in self.transfers]
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        if not self.transfers:
            return empty_descs(), offsets
        return np.concatenate([t.descs for t in self.transfers]), offsets

    def sections(self) -> list[Section]:
        """What the receiver counts: every KV chunk with pages, each non-empty component, each aux row."""
        out, at = [], 0
        for i, t in enumerate(self.transfers):
            pieces = [(KV_ROLE, "kv", t.kv_descs, len(t.dst_pages))]
            pieces += [(c, comp.name, comp.descs, 1 if len(comp.dst_list) else 0) for c, comp in enumerate(t.state)]
            pieces.append((AUX_ROLE, "aux", t.aux_descs, 1))
            for role, name, descs, count in pieces:
                if len(descs) and count:
                    out.append(Section(i, t.request, role, name, at, at + len(descs), count))
                at += len(descs)
        return out

    def assert_equal(self, other: "Plan") -> None:
        """Raise ``AssertionError`` naming the first field where two plans differ."""
        assert len(self.transfers) == len(other.transfers), (
            f"{len(self.transfers)} transfers vs {len(other.transfers)}"
        )
        for i, (a, b) in enumerate(zip(self.transfers, other.transfers)):
            for f in fields(TransferPlan):
                x, y = getattr(a, f.name), getattr(b, f.name)
                if f.name == "state":
                    assert len(x) == len(y), f"transfer {i}: {len(x)} vs {len(y)} components"
                    for c, (cx, cy) in enumerate(zip(x, y)):
                        for g in fields(ComponentPlan):
                            _assert_same(f"transfer {i} component {c} {g.name}", getattr(cx, g.name), getattr(cy, g.name))
                else:
                    _assert_same(f"transfer {i} ({a.request!r}) {f.name}", x, y)


def _assert_same(where: str, x: object, y: object) -> None:
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype, f"{where}: dtype {x.dtype} vs {y.dtype}"
        assert x.shape == y.shape, f"{where}: shape {x.shape} vs {y.shape}"
        if not np.array_equal(x, y):
            first = np.argwhere(x != y)[0]
            raise AssertionError(f"{where}: first difference at {tuple(first)}: {x[tuple(first)]} vs {y[tuple(first)]}")
    else:
        assert x == y, f"{where}: {x!r} vs {y!r}"
