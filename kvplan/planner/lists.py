"""Index lists of many requests computed on the device in a few launches, shared by both sides.

The prefill planner (:mod:`kvplan.planner.gpu`) and the decode side's publication
(:mod:`kvplan.planner.destinations`) describe each list as a :class:`Segment`: which kernel
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

from ..errors import AllocatorInvariantError, InputError, PoolBoundsError, UnmappedSlotError
from ..kernels import index_lists as ki
from ..kernels import slot_check as ks
from .model import Policy, StateComponent, StateKind
from .reference import cdiv

log = logging.getLogger("kvplan")

__all__ = ["ListJob", "Packer", "Segment", "as_device_tensor", "component_segment", "host_empty", "pages_segment",
           "raise_list_errors"]


@dataclass
class Segment:
    """One list of one request: ``n`` ids by the kernel formula ``kind`` (see index_lists)."""

    owner: int  # index of the transfer or request it belongs to
    role: int  # KV (-1), AUX (-2) or a component index
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
    what: str = ""


def pages_segment(owner: int, row: int, a: int, end: int, page_size: int, num_pages: int, validate: bool,
                  n: int | None = None) -> Segment:
    """KV pages of tokens ``[a, end)`` (``n`` overrides the count after truncation)."""
    check = (row, a, end - a, page_size) if validate and end > a else None
    count = cdiv(end - a, page_size) if n is None else n
    return Segment(owner, -1, ki.TOKEN_PAGES, row, a, page_size, count, 1, num_pages, check=check, what="KV page")


def component_segment(owner: int, c: int, comp: StateComponent, side_page_size: int, row: int, seq: int,
                      validate: bool) -> Segment:
    """Component ``c``'s list for ``row`` over ``seq`` tokens (planning.md §6)."""
    comp.require_map()
    if comp.kind is StateKind.MAMBA:
        return Segment(owner, c, ki.ROW_MAP, row, 0, 1, 1, 0, comp.num_items, map_key=c, what=comp.name)
    if comp.kind is StateKind.SWA_RING:
        lo = max(0, seq - comp.window)
        return Segment(owner, c, ki.RING, row, lo, 1, seq - lo, 0, comp.num_items, ring=comp.ring_size,
                       what=comp.name)
    ps = comp.pages_of(side_page_size)
    if comp.kind is StateKind.DSA:
        return Segment(owner, c, ki.TOKEN_PAGES, row, 0, ps, cdiv(seq, ps), 1, comp.num_items,
                       check=(row, 0, seq, ps) if validate and seq else None, what=comp.name)
    ws = (max(0, seq - comp.window) // ps) * ps
    return Segment(owner, c, ki.MAPPED_PAGES, row, ws, ps, cdiv(seq - ws, ps), 1, comp.num_items, map_key=c,
                   check=(row, ws, seq - ws, ps) if validate and seq > ws else None, what=comp.name)


def host_empty(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer, pinned when the device is a GPU (so copies into it are asynchronous)."""
    return torch.empty(n, dtype=dtype, pin_memory=device.type == "cuda")


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

    def __init__(self, segments: Sequence[Segment], maps: dict[int, torch.Tensor], packer: Packer, block: int):
        self.segments, self.maps, self.packer, self.block = segments, maps, packer, block
        S = len(segments)
        self.counts = np.array([s.n for s in segments], dtype=np.int64)
        self.seg_off = np.cumsum(self.counts) - self.counts
        self.total = int(self.counts.sum())
        meta = np.zeros((max(S, 1), ki.NUM_FIELDS), dtype=np.int64)
        check_meta = np.zeros((max(S, 1), ks.NUM_FIELDS), dtype=np.int64)
        index_groups: dict[int | None, list[int]] = {}
        check_groups: dict[int | None, list[int]] = {}
        for i, s in enumerate(segments):
            paged = s.kind in (ki.TOKEN_PAGES, ki.MAPPED_PAGES)
            meta[i] = (s.kind, s.row, s.a, s.step, s.step if paged else 1, s.ring, s.n, self.seg_off[i], s.lo, s.hi,
                       maps[s.map_key].numel() if s.map_key is not None else 0)
            index_groups.setdefault(s.map_key, []).append(i)
            if s.check is not None:
                check_meta[i] = s.check
                check_groups.setdefault(s.map_key, []).append(i)
        self.meta_span, self.check_span = packer.add(meta), packer.add(check_meta)
        # the error words start as NO_ERROR and travel with the same copy (no fill kernels)
        self.errors_span = packer.add(np.full(max(S, 1) * 3, ki.NO_ERROR, dtype=np.int64))
        self.index_progs = {k: self._programs(ids, self.counts) for k, ids in index_groups.items()}
        self.check_progs = {k: self._programs(ids, check_meta[:, 2]) for k, ids in check_groups.items()}

    def _programs(self, ids: list[int], sizes: np.ndarray) -> tuple[tuple[int, int], tuple[int, int]]:
        seg_ids = np.array(ids, dtype=np.int64)
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


def raise_list_errors(segments: Sequence[Segment], order: Sequence[Sequence[int]], request_of: Callable[[int], Any],
                      errors: np.ndarray, invariant: np.ndarray, ids: np.ndarray, seg_off: np.ndarray,
                      policy: Policy) -> None:
    """Raise the first error the kernels flagged, walking owners in ``order`` (segment ids per owner)."""
    errors = errors.reshape(-1, 2)
    for owner_segments in order:
        for s in owner_segments:
            seg = segments[s]
            request = request_of(seg.owner)
            bound, unmapped, inv = int(errors[s, 0]), int(errors[s, 1]), int(invariant[s])
            if unmapped < ki.NO_ERROR:
                pos = seg.a + unmapped * seg.step
                if policy is Policy.STRICT:
                    raise UnmappedSlotError(request, f"{seg.what}: token {pos} inside the window has no SWA slot")
                log.warning("request %r: %s: token %d has no SWA slot; sending page 0 as SGLang does",
                            request, seg.what, pos)
            elif inv < ki.NO_ERROR:
                raise AllocatorInvariantError(
                    request, f"{'KV' if seg.role == -1 else seg.what}: token {seg.check[1] + inv} breaks the paged "
                    f"allocator invariant (page size {seg.check[3]})")
            if bound < ki.NO_ERROR:
                value = int(ids[seg_off[s] + bound]) if bound < seg.n else -1
                raise PoolBoundsError(request, f"{seg.what} index {value} at position {bound} is outside the pool "
                                      f"[{seg.lo}, {seg.hi})")
