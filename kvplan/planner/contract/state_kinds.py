"""Every state kind of planning.md §6 described once: its parameters, list formula and rules.

A hybrid model's state component has a :class:`~kvplan.planner.contract.batch.StateKind`. Everything
that differs between kinds lives in that kind's :class:`KindRules` here: which parameters it
needs, the formula of its index list (on the host for the reference, and as the index-list
kernel's formula for the device), whether a length mismatch may be truncated, whether its lists
merge into runs, and its code in the batch-layout kernel. The rest of the package asks
:func:`rules_of` and never branches on the kind. Adding a kind means adding it to the enum and
one :class:`KindRules` entry below (and its formula to the kernels when it needs a new one).

Example::

    from kvplan.planner.contract.state_kinds import rules_of
    rules = rules_of(StateKind.MAMBA)
    rules.forms_runs, rules.always_strict      # (False, True): one descriptor per slot, no truncation
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...errors import InputError, LayoutError, UnmappedSlotError
from ...kernels import batch_layout as kl
from ...kernels import index_lists as ki
from .batch import Policy, SideMemory, StateComponent, StateKind, use_kind_rules
from .rules import cdiv, check_bounds, check_paged_slots, check_row, host, token_pages

__all__ = ["KindRules", "ListShape", "RULES", "rules_of", "state_list"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ListShape:
    """A component's list for one row over ``seq`` tokens in the index-list kernel's terms.

    ``formula`` is one of :mod:`kvplan.kernels.index_lists`' list kinds; ids ``[a, a + n*step)``
    by that formula are valid in ``[lowest, pool)``; ``checked`` is ``(first token, tokens)``
    checked against the allocator invariant (``None``: nothing to check).
    """

    formula: int
    a: int
    step: int
    n: int
    lowest: int
    ring: int = 1
    uses_map: bool = False
    checked: tuple[int, int] | None = None


HostList = Callable[[SideMemory, StateComponent, int, int, Any, Policy, bool, int], np.ndarray]


@dataclass(frozen=True)
class KindRules:
    """What one state kind is (planning.md §6).

    Attributes:
        kind: the kind described.
        layout_code: its code in the batch-layout kernel (``kvplan.kernels.batch_layout``).
        needs_window: a sliding window ``W >= 1`` is required.
        needs_ring: ``ring_size >= 1`` is required.
        needs_map: lists are computed through the component's ``slot_map``.
        map_by_row: the map is indexed by the request's row (else by full token slot).
        always_strict: a length mismatch is an error under every policy.
        forms_runs: paired lists merge into contiguous runs (else one descriptor per id).
        paged: lists are in pages of the component's page size (which follows the side's KV page
            size unless set), so they depend on each side's page size (docs/page_sizes.md §6).
        maps_pages: a paged kind whose pages may differ between the sides (moved in units of the
            gcd of its page sizes; docs/page_sizes.md §6). Pairing refuses a paged kind without it.
        slices_heads: its items hold per-token KV of the rank's heads, so it is head-sliced exactly
            when KV is (different attention TP sizes; docs/tp_state.md). Other kinds are replicated
            across ranks and move whole.
        shards_tensors: its entries are sharded along a tensor dimension across ranks
            (:class:`~kvplan.planner.contract.batch.TensorShard`), so between different TP sizes each entry
            moves in byte blocks of its item (docs/tp_state.md §4).
        starts_at_prefix: the kind has SGLang 0.5.23's variant after a decode prefix ``P``
            (``StateComponent.from_prefix``): its list starts no earlier than ``P``.
        list_start: ``(component, its page size, seq, prefix) -> position`` where a paged list's
            first page starts (the SWA window start; 0 for DSA, or ``P`` with ``from_prefix``).
        list_shape: ``(component, side page size, seq, prefix) -> ListShape`` for the device kernels.
        host_list: the list on the host, validated (the reference's formula); its last argument is
            the decode prefix ``P``.
    """

    kind: StateKind
    layout_code: int
    needs_window: bool
    needs_ring: bool
    needs_map: bool
    map_by_row: bool
    always_strict: bool
    forms_runs: bool
    paged: bool
    maps_pages: bool
    slices_heads: bool
    shards_tensors: bool
    starts_at_prefix: bool
    list_start: Callable[[StateComponent, int, int, int], int]
    list_shape: Callable[[StateComponent, int, int, int], ListShape]
    host_list: HostList

    def validate(self, comp: StateComponent) -> None:
        """Raise :class:`LayoutError` unless ``comp`` has the parameters this kind needs."""
        if self.needs_window and comp.window < 1:
            raise LayoutError(f"component {comp.name}: a window >= 1 is required")
        if self.needs_ring and comp.ring_size < 1:
            raise LayoutError(f"component {comp.name}: ring_size >= 1 is required")
        if comp.from_prefix and not self.starts_at_prefix:
            raise LayoutError(f"component {comp.name}: from_prefix is SGLang's variant for SWA and DSA lists; "
                              f"{comp.kind.value} lists have no other start")

    def require_map(self, comp: StateComponent) -> None:
        if self.needs_map and comp.slot_map is None:
            raise LayoutError(f"component {comp.name}: a slot_map is required to compute {comp.kind.value} lists")


def _from_zero(comp: StateComponent, ps: int, seq: int, prefix: int = 0) -> int:
    return 0


def _floor(comp: StateComponent, prefix: int) -> int:
    """The first position a paged list may start at: the decode prefix with ``from_prefix``, else 0."""
    return prefix if comp.from_prefix else 0


def _lists_from(comp: StateComponent, ps: int, seq: int, prefix: int = 0) -> int:
    return _floor(comp, prefix)


# --------------------------------------------------------------------------------------------
# SWA: pages of full_to_swa over the page-aligned window


def _swa_window_start(comp: StateComponent, ps: int, seq: int, prefix: int = 0) -> int:
    return (max(_floor(comp, prefix), seq - comp.window) // ps) * ps


def _swa_shape(comp: StateComponent, side_ps: int, seq: int, prefix: int = 0) -> ListShape:
    ps = comp.pages_of(side_ps)
    ws = _swa_window_start(comp, ps, seq, prefix)
    return ListShape(int(ki.MAPPED_PAGES), ws, ps, max(0, cdiv(seq - ws, ps)), 1, uses_map=True,
                     checked=(ws, seq - ws) if seq > ws else None)


def _swa_list(side: SideMemory, comp: StateComponent, row: int, seq: int, request: Any, policy: Policy,
              validate: bool, prefix: int = 0) -> np.ndarray:
    table = host(side.req_to_token)
    ps = comp.pages_of(side.kv.page_size)
    check_row(request, table.shape, row, seq)
    ws = _swa_window_start(comp, ps, seq, prefix)
    slot_map = host(comp.slot_map)
    full = table[row, ws:seq].astype(np.int64)
    check_bounds(request, f"{comp.name} full slot", full, 0, slot_map.shape[0])
    swa = slot_map[full].astype(np.int64)
    sampled = swa[::ps]
    unmapped = np.flatnonzero(sampled == 0)
    if unmapped.size:
        pos = ws + int(unmapped[0]) * ps
        if policy is Policy.STRICT:
            raise UnmappedSlotError(request, f"{comp.name}: token {pos} inside the window has no SWA slot")
        log.warning("request %r: %s: token %d has no SWA slot; sending page 0 as SGLang does", request, comp.name, pos)
    elif validate:
        check_paged_slots(request, comp.name, swa, ws, ps)
    ids = sampled // ps
    check_bounds(request, comp.name, ids[sampled != 0], 1, comp.num_items)
    return ids


# --------------------------------------------------------------------------------------------
# DSA: the indexer's pages over the whole sequence


def _dsa_shape(comp: StateComponent, side_ps: int, seq: int, prefix: int = 0) -> ListShape:
    ps = comp.pages_of(side_ps)
    lo = _floor(comp, prefix)
    return ListShape(int(ki.TOKEN_PAGES), lo, ps, max(0, cdiv(seq - lo, ps)), 1,
                     checked=(lo, seq - lo) if seq > lo else None)


def _dsa_list(side: SideMemory, comp: StateComponent, row: int, seq: int, request: Any, policy: Policy,
              validate: bool, prefix: int = 0) -> np.ndarray:
    table = host(side.req_to_token)
    ps = comp.pages_of(side.kv.page_size)
    check_row(request, table.shape, row, seq)
    lo = _floor(comp, prefix)
    if validate and seq > lo:
        check_paged_slots(request, comp.name, table[row, lo:seq].astype(np.int64), lo, ps)
    ids = token_pages(table, row, lo, seq, ps)
    check_bounds(request, comp.name, ids, 1, comp.num_items)
    return ids


# --------------------------------------------------------------------------------------------
# SWA_RING: the last W tokens' rows of a per-request ring


def _ring_shape(comp: StateComponent, side_ps: int, seq: int, prefix: int = 0) -> ListShape:
    lo = max(0, seq - comp.window)
    return ListShape(int(ki.RING), lo, 1, seq - lo, 0, ring=comp.ring_size)


def _ring_list(side: SideMemory, comp: StateComponent, row: int, seq: int, request: Any, policy: Policy,
               validate: bool, prefix: int = 0) -> np.ndarray:
    lo = max(0, seq - comp.window)
    ids = row * comp.ring_size + np.arange(lo, seq, dtype=np.int64) % comp.ring_size
    check_bounds(request, comp.name, ids, 0, comp.num_items)
    return ids


# --------------------------------------------------------------------------------------------
# MAMBA: one slot per request, through the row -> slot map


def _mamba_shape(comp: StateComponent, side_ps: int, seq: int, prefix: int = 0) -> ListShape:
    return ListShape(int(ki.ROW_MAP), 0, 1, 1, 0, uses_map=True)


def _mamba_list(side: SideMemory, comp: StateComponent, row: int, seq: int, request: Any, policy: Policy,
                validate: bool, prefix: int = 0) -> np.ndarray:
    slot_map = host(comp.slot_map)
    if not 0 <= row < slot_map.shape[0]:
        raise InputError(request, f"{comp.name}: row {row} is outside the Mamba map of {slot_map.shape[0]} rows")
    ids = slot_map[row : row + 1].astype(np.int64)
    check_bounds(request, comp.name, ids, 0, comp.num_items)
    return ids


RULES: dict[StateKind, KindRules] = {
    StateKind.SWA: KindRules(StateKind.SWA, int(kl.SWA), needs_window=True, needs_ring=False, needs_map=True,
                             map_by_row=False, always_strict=False, forms_runs=True, paged=True, maps_pages=True,
                             slices_heads=True, shards_tensors=False, starts_at_prefix=True,
                             list_start=_swa_window_start,
                             list_shape=_swa_shape, host_list=_swa_list),
    StateKind.DSA: KindRules(StateKind.DSA, int(kl.DSA), needs_window=False, needs_ring=False, needs_map=False,
                             map_by_row=False, always_strict=False, forms_runs=True, paged=True, maps_pages=True,
                             slices_heads=False, shards_tensors=False, starts_at_prefix=True,
                             list_start=_lists_from, list_shape=_dsa_shape,
                             host_list=_dsa_list),
    StateKind.SWA_RING: KindRules(StateKind.SWA_RING, int(kl.SWA_RING), needs_window=True, needs_ring=True,
                                  needs_map=False, map_by_row=False, always_strict=True, forms_runs=True, paged=False,
                                  maps_pages=False, slices_heads=False, shards_tensors=False,
                                  starts_at_prefix=False, list_start=_from_zero,
                                  list_shape=_ring_shape, host_list=_ring_list),
    StateKind.MAMBA: KindRules(StateKind.MAMBA, int(kl.MAMBA), needs_window=False, needs_ring=False, needs_map=True,
                               map_by_row=True, always_strict=True, forms_runs=False, paged=False,
                               maps_pages=False, slices_heads=False, shards_tensors=True,
                               starts_at_prefix=False, list_start=_from_zero,
                               list_shape=_mamba_shape, host_list=_mamba_list),
}


def rules_of(kind: StateKind) -> KindRules:
    """The rules of ``kind``; a kind without rules is a :class:`LayoutError`, never a fallthrough."""
    try:
        return RULES[StateKind(kind)]
    except (KeyError, ValueError):
        raise LayoutError(f"state kind {kind!r} has no rules in kvplan.planner.contract.state_kinds") from None


use_kind_rules(rules_of)  # components validate themselves through it (kvplan.planner.contract.batch)


def state_list(side: SideMemory, comp: StateComponent, row: int, seq: int, request: Any = None,
               policy: Policy = Policy.STRICT, validate: bool = True, prefix: int = 0) -> np.ndarray:
    """A component's index list for row ``row`` over ``seq`` tokens (planning.md §6), validated.
    ``prefix`` is the request's decode prefix; only a ``from_prefix`` component's list depends on it."""
    rules = rules_of(comp.kind)
    rules.require_map(comp)
    return rules.host_list(side, comp, row, seq, request, policy, validate, prefix)
