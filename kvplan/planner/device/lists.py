"""Index lists of many requests computed on the device in a few launches, shared by both sides.

The prefill planner (:mod:`kvplan.planner.device.eager`) and the decode side's publication
(:mod:`kvplan.planner.device.destinations`) describe each list as a :class:`Segment`: which kernel
formula, which row and token range, which pool bounds, which slot map, which token range to check
against the allocator invariant. :class:`ListJob` packs every segment's metadata into the batch's
single host-to-device copy and launches one index-list kernel per slot map (plus one without a
map) and one invariant check per map. :func:`raise_list_errors` turns what the kernels flagged
into exceptions that name the request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ...errors import AllocatorInvariantError, InputError, PoolBoundsError, UnmappedSlotError
from ...kernels import index_lists as ki
from ...kernels import slot_check as ks
from ..contract.batch import Policy, StateComponent
from ..contract.plan import Role
from ..contract.rules import cdiv
from ..contract.state_kinds import rules_of

log = logging.getLogger(__name__)

__all__ = ["ListJob", "Packer", "Segment", "SegmentTable", "as_device_tensor", "component_segment", "host_empty", "pages_segment",
           "raise_list_errors"]


@dataclass
class Segment:
    """One list of one request: ``n`` ids by the kernel formula ``kind`` (see index_lists)."""

    owner: int  # index of the transfer or request it belongs to
    role: int  # Role.KV, Role.AUX or a component index
    kind: int
    row: int
    a: int
    step: int
    n: int
    lo: int
    hi: int
    ring: int = 1
    map_key: int | None = None  # component index whose slot map the segment reads
    check: tuple[int, int, int, int] | None = None  # (row, a, tokens, page size) for the invariant


_FIELDS = ("owner", "role", "kind", "row", "a", "step", "n", "lo", "hi", "ring", "map_key")


@dataclass
class SegmentTable:
    """Segments as columns (int64 arrays of length ``S``), in owner order; ``map_key`` -1 = no map;
    ``check`` is ``[S, 4]`` ``(row, a, tokens, page size)`` with ``tokens == 0`` for no check."""

    owner: np.ndarray
    role: np.ndarray
    kind: np.ndarray
    row: np.ndarray
    a: np.ndarray
    step: np.ndarray
    n: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    ring: np.ndarray
    map_key: np.ndarray
    check: np.ndarray

    def __len__(self) -> int:
        return len(self.n)

    @classmethod
    def from_segments(cls, segments: Sequence[Segment]) -> "SegmentTable":
        cols = {f: np.array([getattr(s, f) if f != "map_key" or s.map_key is not None else -1 for s in segments],
                            dtype=np.int64) for f in _FIELDS}
        check = np.array([s.check or (0, 0, 0, 1) for s in segments], dtype=np.int64).reshape(-1, 4)
        return cls(**cols, check=check)

    def what(self, s: int, component_names: Sequence[str]) -> str:
        role = int(self.role[s])
        return "KV page" if role == Role.KV else "aux" if role == Role.AUX else component_names[role]


def pages_segment(owner: int, row: int, a: int, end: int, page_size: int, num_pages: int, validate: bool,
                  n: int | None = None) -> Segment:
    """KV pages of tokens ``[a, end)`` (``n`` overrides the count after truncation)."""
    check = (row, a, end - a, page_size) if validate and end > a else None
    count = cdiv(end - a, page_size) if n is None else n
    return Segment(owner, Role.KV, ki.TOKEN_PAGES, row, a, page_size, count, 1, num_pages, check=check)


def component_segment(owner: int, c: int, comp: StateComponent, side_page_size: int, row: int, seq: int,
                      validate: bool, prefix: int = 0) -> Segment:
    """Component ``c``'s list for ``row`` over ``seq`` tokens after a decode prefix of ``prefix``
    tokens (planning.md §6), by its kind's formula."""
    rules = rules_of(comp.kind)
    rules.require_map(comp)
    shape = rules.list_shape(comp, side_page_size, seq, prefix)
    check = (row, *shape.checked, shape.step) if validate and shape.checked else None
    return Segment(owner, c, shape.formula, row, shape.a, shape.step, shape.n, shape.lowest, comp.num_items,
                   ring=shape.ring, map_key=c if shape.uses_map else None, check=check)


def host_empty(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer, pinned when the device is a GPU (so copies into it are asynchronous)."""
    return torch.empty(n, dtype=dtype, pin_memory=device.type == "cuda")


def require_same_device(side: Any, device: torch.device) -> None:
    """Raise :class:`InputError` naming the first slot map of ``side``'s state that is a tensor on another
    device than its token table's (checked before anything asks whether kernels run on ``device``)."""
    for comp in side.state:
        values = comp.slot_map
        if isinstance(values, torch.Tensor) and values.device != device:
            raise InputError(None, f"slot_map of component {comp.name} is on {values.device}, the token table "
                                   f"(req_to_token) on {device}: put both on one device")


def as_device_tensor(values: Any, device: torch.device, what: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` as a tensor on ``device`` (NumPy is accepted on the CPU only), cast to ``dtype``."""
    if isinstance(values, np.ndarray):
        if device.type != "cpu":
            raise InputError(None, f"{what} must be a tensor on {device}, got a NumPy array")
        values = torch.from_numpy(values)
    if not isinstance(values, torch.Tensor):
        raise InputError(None, f"{what} must be a tensor, got {type(values).__name__}")
    if values.device != device:
        raise InputError(None, f"{what} is on {values.device}, the token table on {device}")
    if dtype is not None and values.dtype != dtype:
        if values.is_floating_point() or values.dtype == torch.bool:
            raise InputError(None, f"{what} must hold integers, got {values.dtype}")
        values = values.to(dtype)
    return values


class Packer:
    """Host int64 arrays concatenated into one buffer, shipped with a single asynchronous copy."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.size = 0
        self.device_buffer: torch.Tensor | None = None

    def add(self, values: Any) -> tuple[int, int]:
        arr = np.ascontiguousarray(values).reshape(-1)
        arr = arr.view(np.int64) if arr.dtype == np.uint64 else arr.astype(np.int64, copy=False)
        self.parts.append(arr)
        span = (self.size, arr.size)
        self.size += arr.size
        return span

    def ship(self, device: torch.device) -> torch.Tensor:
        """Copy everything added to ``device``; returns the pinned staging buffer to keep alive."""
        staging = host_empty(max(1, self.size), torch.int64, device)
        if self.size:
            np.concatenate(self.parts, out=staging.numpy()[: self.size])
        self.device_buffer = staging.to(device, non_blocking=True)
        return staging

    def view(self, span: tuple[int, int]) -> torch.Tensor:
        return self.device_buffer[span[0] : span[0] + span[1]]


class ListJob:
    """The index-list and invariant-check launches of a set of segments."""

    def __init__(self, segments: SegmentTable, maps: dict[int, torch.Tensor], packer: Packer, block: int):
        self.segments, self.maps, self.packer, self.block = segments, maps, packer, block
        t = segments
        S = len(t)
        self.counts = t.n
        self.seg_off = np.cumsum(t.n) - t.n
        self.total = int(t.n.sum())
        paged = (t.kind == ki.TOKEN_PAGES) | (t.kind == ki.MAPPED_PAGES)
        map_len = np.zeros(S, dtype=np.int64)
        for key, tensor in maps.items():
            map_len[t.map_key == key] = tensor.numel()
        meta = np.stack([t.kind, t.row, t.a, t.step, np.where(paged, t.step, 1), t.ring, t.n, self.seg_off, t.lo, t.hi,
                         map_len], axis=1) if S else np.zeros((1, ki.NUM_FIELDS), dtype=np.int64)
        check_meta = t.check if S else np.zeros((1, ks.NUM_FIELDS), dtype=np.int64)
        self.meta_span, self.check_span = packer.add(meta), packer.add(check_meta)
        # the error words start as NO_ERROR and travel with the same copy (no fill kernels)
        self.errors_span = packer.add(np.full(max(S, 1) * 3, ki.NO_ERROR, dtype=np.int64))
        checked = t.check[:, 2] > 0
        self.index_progs, self.check_progs = {}, {}
        for key in (-1, *maps):  # one launch per slot map (and one for lists without a map)
            uses = t.map_key == key
            if uses.any():
                self.index_progs[key] = self._programs(np.flatnonzero(uses), t.n)
            if (uses & checked).any():
                self.check_progs[key] = self._programs(np.flatnonzero(uses & checked), t.check[:, 2])

    def _programs(self, seg_ids: np.ndarray, sizes: np.ndarray) -> tuple[tuple[int, int], tuple[int, int]]:
        prog_seg, prog_off = ki.programs_over(sizes[seg_ids], self.block)
        return self.packer.add(seg_ids[prog_seg]), self.packer.add(prog_off)

    def launch(self, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids, errors [S, 2], invariant [S])`` on the device; call after :meth:`Packer.ship`."""
        device, view, S = table.device, self.packer.view, max(len(self.segments), 1)
        ids = torch.empty(max(1, self.total), dtype=torch.int64, device=device)
        words = view(self.errors_span)
        errors, invariant = words[: S * 2], words[S * 2 :]
        for key, (ps, po) in self.index_progs.items():
            ki.index_lists(view(self.meta_span), view(ps), view(po), table, self.maps.get(key), ids, errors, self.block)
        for key, (ps, po) in self.check_progs.items():
            ks.check_slots(view(self.check_span), view(ps), view(po), table, self.maps.get(key), invariant, self.block)
        return ids, errors, invariant


def raise_list_errors(segments: SegmentTable, component_names: Sequence[str], request_of: Callable[[int], Any],
                      errors: np.ndarray, invariant: np.ndarray, ids: np.ndarray, seg_off: np.ndarray,
                      policy: Policy) -> None:
    """Raise the first error the kernels flagged, in segment (so owner) order.

    Within a segment an unmapped SWA slot comes first (an error under ``strict``, a warning under
    ``truncate``, which then skips the invariant as the reference does), then the allocator
    invariant, then pool bounds.
    """
    errors = errors.reshape(-1, 2)[: len(segments)]
    invariant = invariant[: len(segments)]
    bound, unmapped, inv = errors[:, 0] < ki.NO_ERROR, errors[:, 1] < ki.NO_ERROR, invariant < ki.NO_ERROR
    strict = policy is Policy.STRICT
    if not strict:
        for s in np.flatnonzero(unmapped):
            pos = int(segments.a[s] + errors[s, 1] * segments.step[s])
            log.warning("request %r: %s: token %d has no SWA slot; sending page 0 as SGLang does",
                        request_of(int(segments.owner[s])), segments.what(s, component_names), pos)
    fatal = bound | (inv & ~unmapped) | (unmapped & strict)
    if not fatal.any():
        return
    s = int(np.flatnonzero(fatal)[0])
    request, what = request_of(int(segments.owner[s])), segments.what(s, component_names)
    if unmapped[s]:
        pos = int(segments.a[s] + errors[s, 1] * segments.step[s])
        raise UnmappedSlotError(request, f"{what}: token {pos} inside the window has no SWA slot")
    if inv[s]:
        row, a, _, ps = (int(x) for x in segments.check[s])
        raise AllocatorInvariantError(request, f"{'KV' if segments.role[s] == Role.KV else what}: token {a + int(invariant[s])} "
                                      f"breaks the paged allocator invariant (page size {ps})")
    k = int(errors[s, 0])
    value = int(ids[seg_off[s] + k]) if k < segments.n[s] else -1
    raise PoolBoundsError(request, f"{what} index {value} at position {k} is outside the pool "
                          f"[{int(segments.lo[s])}, {int(segments.hi[s])})")
