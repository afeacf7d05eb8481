"""The NumPy reference planner: planning.md, written to be slow and obviously right.

Every kernel of kvplan is compared against this module. It walks the batch one transfer at a
time, with plain NumPy on host copies of the inputs.

Example::

    from kvplan.planner.reference import plan_reference
    plan = plan_reference(batch)           # batch: kvplan.planner.model.Batch
    descs, offsets = plan.descriptors()    # [n, 3] uint64, [transfers + 1]
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import (
    AlignmentError,
    AllocatorInvariantError,
    InputError,
    LengthMismatchError,
    PoolBoundsError,
    UnmappedSlotError,
)
from .model import Batch, Policy, SideMemory, StateComponent, StateKind, Transfer
from .pairing import HeadSlice, Mode, SidePairing, pair_sides
from .plan import ComponentPlan, Plan, TransferPlan, empty_descs, empty_runs

__all__ = [
    "DestinationLists",
    "chunk_end",
    "contiguous_runs",
    "destination_lists",
    "direct_descriptors",
    "head_sliced_descriptors",
    "plan_reference",
    "state_list",
    "token_pages",
]

log = logging.getLogger("kvplan")

_U64 = np.uint64


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def host(values: Any) -> np.ndarray:
    """A host NumPy view or copy of an array-like (CPU or CUDA tensor, array, list)."""
    if hasattr(values, "detach"):
        return values.detach().cpu().numpy()
    return np.asarray(values)


# --------------------------------------------------------------------------------------------
# Lists (planning.md §2, §3, §6)


def chunk_end(start: int, fill_len: int, prompt_len: int, page_size: int, last: bool) -> int:
    """Where a chunk starting at ``start`` ends (planning.md §3).

    A non-last chunk stops at the last full page of ``min(fill_len, prompt_len)``; the last chunk
    ends at ``min(fill_len, prompt_len)``, so the sampled token's KV is never sent.

    >>> chunk_end(0, 100, 200, 64, last=False), chunk_end(64, 201, 200, 64, last=True)
    (64, 200)
    """
    seq = min(fill_len, prompt_len)
    return seq if last else max(start, (seq // page_size) * page_size)


def token_pages(table: np.ndarray, row: int, a: int, b: int, page_size: int) -> np.ndarray:
    """``pages(row, a, b)`` of planning.md §2: the page of every ``page_size``-th slot from ``a``."""
    return (table[row, a:b:page_size].astype(np.int64)) // page_size


def check_row(request: Any, table_shape: tuple[int, ...], row: int, end: int) -> None:
    """The row is a real request row (not padding row 0) and ``end`` fits the table."""
    if not 0 < row < table_shape[0]:
        raise InputError(request, f"row {row} is outside the token table's rows [1, {table_shape[0]})")
    if end > table_shape[1]:
        raise InputError(request, f"token {end} is beyond the token table's {table_shape[1]} columns")


def check_bounds(request: Any, what: str, ids: np.ndarray, lowest: int, count: int) -> None:
    bad = np.flatnonzero((ids < lowest) | (ids >= count))
    if bad.size:
        k = int(bad[0])
        raise PoolBoundsError(
            request, f"{what} index {int(ids[k])} at position {k} is outside the pool [{lowest}, {count})"
        )


def _check_paged_slots(request: Any, what: str, slots: np.ndarray, a: int, page_size: int) -> None:
    """Every slot of positions ``a, a+1, ...`` must equal ``page * ps + pos % ps`` of its page."""
    pos = np.arange(a, a + slots.size)
    first = slots[(pos - a) // page_size * page_size]
    expected = (first // page_size) * page_size + pos % page_size
    bad = np.flatnonzero(slots != expected)
    if bad.size:
        k = int(bad[0])
        raise AllocatorInvariantError(
            request,
            f"{what}: slot {int(slots[k])} of token {int(pos[k])} breaks the paged allocator invariant "
            f"(expected {int(expected[k])} for page size {page_size})",
        )


def paired_length(request: Any, what: str, n_src: int, n_dst: int, policy: Policy, always_strict: bool = False) -> int:
    """The common length of two paired lists: an error under strict, else the shorter with a warning."""
    if n_src == n_dst:
        return n_src
    if policy is Policy.STRICT or always_strict:
        raise LengthMismatchError(request, f"{what}: source list has {n_src} entries, destination {n_dst}")
    n = min(n_src, n_dst)
    log.warning("request %r: %s: truncating source %d / destination %d to %d", request, what, n_src, n_dst, n)
    return n


@dataclass(frozen=True)
class ChunkRange:
    """A chunk resolved from lengths alone (planning.md §3): its end, pages and last-ness."""

    end: int
    pages: int  # source pages sent (after truncation under ``truncate``)
    dst_pages: np.ndarray
    last: bool
    sent: bool


def resolve_chunk(t: Transfer, page_size: int, table_shape: tuple[int, ...], dst_num_pages: int,
                  policy: Policy) -> ChunkRange:
    """Every check of a chunk that needs no token slot: alignment, ranges, lengths, last flag."""
    ps, request = page_size, t.request
    if t.start % ps:
        raise AlignmentError(request, f"chunk start {t.start} is not a multiple of page size {ps}")
    if t.prefix_len % ps or t.start < t.prefix_len:
        raise AlignmentError(request, f"chunk start {t.start} / decode prefix {t.prefix_len} are inconsistent with page size {ps}")
    end = chunk_end(t.start, t.fill_len, t.prompt_len, ps, t.last)
    if end < t.start:
        raise InputError(request, f"chunk [{t.start}, {end}) is empty or reversed (fill_len {t.fill_len}, prompt {t.prompt_len})")
    check_row(request, table_shape, t.src_row, end)
    n = cdiv(end - t.start, ps)
    total, cursor = len(t.dst_pages), (t.start - t.prefix_len) // ps
    dst_pages = t.dst_pages[cursor : cursor + n]
    what = f"chunk [{t.start}, {end}) KV pages"
    if len(dst_pages) < n:
        if policy is Policy.STRICT:
            raise LengthMismatchError(request, f"{what}: {n} source pages, {len(dst_pages)} destination pages left")
        log.warning("request %r: %s: truncating %d source pages to %d", request, what, n, len(dst_pages))
        n = len(dst_pages)
    check_bounds(request, "destination KV page", dst_pages, 1, dst_num_pages)
    last = cursor + len(dst_pages) >= total
    if last != t.last and policy is Policy.STRICT:
        raise LengthMismatchError(
            request,
            f"{what}: the scheduler says last={t.last} but the destination pages say last={last} "
            f"(cursor {cursor} + {len(dst_pages)} of {total})",
        )
    return ChunkRange(end, n, dst_pages, last, last or n > 0)


def check_aux(t: Transfer, src: SideMemory, dst: SideMemory) -> bool:
    """Whether the last chunk carries aux rows; raises if its aux indices are outside the buffers."""
    if not src.aux:
        return False
    if not 0 <= t.aux_src < min(e.num_items for e in src.aux):
        raise PoolBoundsError(t.request, f"source aux index {t.aux_src} is outside the aux buffers")
    if not 0 <= t.aux_dst < min(e.num_items for e in dst.aux):
        raise PoolBoundsError(t.request, f"destination aux index {t.aux_dst} is outside the aux buffers")
    return True


def state_list(
    side: SideMemory,
    comp: StateComponent,
    row: int,
    seq: int,
    request: Any = None,
    policy: Policy = Policy.STRICT,
    validate: bool = True,
) -> np.ndarray:
    """A component's index list for row ``row`` over ``seq`` tokens (planning.md §6), validated."""
    table = host(side.req_to_token)
    kind = comp.kind
    comp.require_map()
    if kind is StateKind.MAMBA:
        slot_map = host(comp.slot_map)
        if not 0 <= row < slot_map.shape[0]:
            raise InputError(request, f"{comp.name}: row {row} is outside the Mamba map of {slot_map.shape[0]} rows")
        ids = slot_map[row : row + 1].astype(np.int64)
        check_bounds(request, comp.name, ids, 0, comp.num_items)
        return ids
    if kind is StateKind.SWA_RING:
        lo = max(0, seq - comp.window)
        ids = row * comp.ring_size + np.arange(lo, seq, dtype=np.int64) % comp.ring_size
        check_bounds(request, comp.name, ids, 0, comp.num_items)
        return ids
    ps = comp.pages_of(side.kv.page_size)
    check_row(request, table.shape, row, seq)
    if kind is StateKind.DSA:
        if validate:
            _check_paged_slots(request, comp.name, table[row, :seq].astype(np.int64), 0, ps)
        ids = token_pages(table, row, 0, seq, ps)
        check_bounds(request, comp.name, ids, 1, comp.num_items)
        return ids
    # SWA: pages of full_to_swa over the page-aligned window
    ws = (max(0, seq - comp.window) // ps) * ps
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
        _check_paged_slots(request, comp.name, swa, ws, ps)
    ids = sampled // ps
    check_bounds(request, comp.name, ids[sampled != 0], 1, comp.num_items)
    return ids


@dataclass(frozen=True)
class DestinationLists:
    """What a decode side publishes for one request: pages for ``[P, L)`` and state lists over ``L``."""

    pages: np.ndarray
    state: tuple[np.ndarray, ...]


def destination_lists(
    side: SideMemory, row: int, prefix_len: int, prompt_len: int, request: Any = None, validate: bool = True
) -> DestinationLists:
    """The decode side's lists for a pre-allocated request (planning.md §3, §6)."""
    ps = side.kv.page_size
    if prefix_len % ps:
        raise AlignmentError(request, f"decode prefix {prefix_len} is not a multiple of page size {ps}")
    table = host(side.req_to_token)
    check_row(request, table.shape, row, prompt_len)
    if validate:
        _check_paged_slots(request, "KV", table[row, prefix_len:prompt_len].astype(np.int64), prefix_len, ps)
    pages = token_pages(table, row, prefix_len, prompt_len, ps)
    check_bounds(request, "KV page", pages, 1, side.kv.num_pages)
    state = tuple(state_list(side, c, row, prompt_len, request, Policy.STRICT, validate) for c in side.state)
    return DestinationLists(pages, state)


# --------------------------------------------------------------------------------------------
# Runs and descriptors (planning.md §4, §5)


def contiguous_runs(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Maximal stretches where both lists step by +1, as ``[R, 3]`` int64 ``(s0, d0, len)``.

    >>> contiguous_runs(np.array([3, 4, 5, 9]), np.array([10, 11, 12, 13])).tolist()
    [[3, 10, 3], [9, 13, 1]]
    """
    if len(src) != len(dst):
        raise ValueError(f"paired lists differ in length: {len(src)} vs {len(dst)}")
    if len(src) == 0:
        return empty_runs()
    src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([starts, [len(src)]]))
    return np.stack([src[starts], dst[starts], lengths], axis=1).astype(np.int64)


def direct_descriptors(src_table: np.ndarray, dst_table: np.ndarray, runs: np.ndarray) -> np.ndarray:
    """Entry-major descriptors: for each entry pair, for each run (planning.md §5, direct mode)."""
    if len(src_table) == 0 or len(runs) == 0:
        return empty_descs()
    item = src_table[:, 1][:, None]
    r = runs.astype(_U64)
    out = np.empty((len(src_table), len(runs), 3), dtype=_U64)
    out[..., 0] = src_table[:, 0][:, None] + r[None, :, 0] * item
    out[..., 1] = dst_table[:, 0][:, None] + r[None, :, 1] * item
    out[..., 2] = r[None, :, 2] * item
    return out.reshape(-1, 3)


def head_sliced_descriptors(
    src_table: np.ndarray,
    dst_table: np.ndarray,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    heads: HeadSlice,
    page_size: int,
) -> np.ndarray:
    """One descriptor per entry x page x token carrying ``heads_sent`` heads (planning.md §5)."""
    if len(src_table) == 0 or len(src_pages) == 0:
        return empty_descs()
    s_item, d_item = src_table[:, 1][:, None, None], dst_table[:, 1][:, None, None]
    sp = src_pages.astype(_U64)[None, :, None]
    dp = dst_pages.astype(_U64)[None, :, None]
    tok = np.arange(page_size, dtype=_U64)[None, None, :]
    shape = (len(src_table), len(src_pages), page_size, 3)
    out = np.empty(shape, dtype=_U64)
    out[..., 0] = (src_table[:, 0][:, None, None] + sp * s_item + tok * _U64(heads.src_token_bytes)
                   + _U64(heads.src_head * heads.bytes_per_head))
    out[..., 1] = (dst_table[:, 0][:, None, None] + dp * d_item + tok * _U64(heads.dst_token_bytes)
                   + _U64(heads.dst_head * heads.bytes_per_head))
    out[..., 2] = _U64(heads.nbytes)
    return out.reshape(-1, 3)


def _runs_or_error(request: Any, what: str, src: np.ndarray, dst: np.ndarray, policy: Policy) -> np.ndarray:
    """Runs of two equal-length lists; exactly one side empty is an error under strict (§4)."""
    if (len(src) == 0) != (len(dst) == 0) and policy is Policy.STRICT:
        raise LengthMismatchError(request, f"{what}: one side is empty ({len(src)} vs {len(dst)} entries)")
    if len(src) == 0 or len(dst) == 0:
        return empty_runs()
    return contiguous_runs(src, dst)


# --------------------------------------------------------------------------------------------
# The batch


def _component_plan(
    request: Any,
    comp: StateComponent,
    src_list: np.ndarray,
    dst_list: np.ndarray,
    src_table: np.ndarray,
    dst_table: np.ndarray,
    policy: Policy,
) -> ComponentPlan:
    always_strict = comp.kind in (StateKind.SWA_RING, StateKind.MAMBA)
    n = paired_length(request, f"state component {comp.name}", len(src_list), len(dst_list), policy, always_strict)
    src_list, dst_list = src_list[:n], dst_list[:n]
    if comp.kind is StateKind.MAMBA:
        runs = empty_runs()
        unit = np.stack([src_list, dst_list, np.ones_like(src_list)], axis=1).astype(np.int64)
        descs = direct_descriptors(src_table, dst_table, unit)
    else:
        runs = _runs_or_error(request, f"state component {comp.name}", src_list, dst_list, policy)
        descs = direct_descriptors(src_table, dst_table, runs)
    return ComponentPlan(comp.name, comp.kind, src_list, dst_list, runs, descs)


def _plan_transfer(batch: Batch, t: Transfer, pairing: SidePairing, dst: SideMemory) -> TransferPlan:
    src, policy = batch.src, batch.policy
    ps = src.kv.page_size
    request = t.request
    table = host(src.req_to_token)
    chunk = resolve_chunk(t, ps, table.shape, dst.kv.num_pages, policy)
    end, dst_pages, last, sent = chunk.end, chunk.dst_pages, chunk.last, chunk.sent
    if batch.validate:
        _check_paged_slots(request, "KV", table[t.src_row, t.start:end].astype(np.int64), t.start, ps)
    src_pages = token_pages(table, t.src_row, t.start, end, ps)
    check_bounds(request, "KV page", src_pages, 1, src.kv.num_pages)
    src_pages = src_pages[: chunk.pages]
    what = f"chunk [{t.start}, {end}) KV pages"
    runs = _runs_or_error(request, what, src_pages, dst_pages, policy) if sent else empty_runs()
    if pairing.mode is Mode.DIRECT:
        kv_descs = direct_descriptors(pairing.kv_src, pairing.kv_dst, runs)
    else:
        kv_descs = head_sliced_descriptors(pairing.kv_src, pairing.kv_dst, src_pages, dst_pages, pairing.heads, ps)

    state: tuple[ComponentPlan, ...] = ()
    aux_descs = empty_descs()
    if last:
        seq = min(t.fill_len, t.prompt_len)
        if len(t.dst_state) != len(src.state):
            raise LengthMismatchError(
                request, f"{len(src.state)} state components on the source, {len(t.dst_state)} destination lists"
            )
        state = tuple(
            _component_plan(
                request,
                comp,
                state_list(src, comp, t.src_row, seq, request, policy, batch.validate),
                dst_list,
                pairing.state_src[c],
                pairing.state_dst[c],
                policy,
            )
            for c, (comp, dst_list) in enumerate(zip(src.state, t.dst_state))
        )
        for c, comp in enumerate(dst.state):
            check_bounds(request, f"destination {comp.name}", state[c].dst_list, 0, comp.num_items)
        if check_aux(t, src, dst):
            aux_descs = direct_descriptors(pairing.aux_src, pairing.aux_dst, np.array([[t.aux_src, t.aux_dst, 1]]))
    return TransferPlan(
        request=request,
        dest=t.dest,
        mode=pairing.mode,
        start=t.start,
        end=end,
        last=last,
        sent=sent,
        src_pages=src_pages,
        dst_pages=dst_pages,
        runs=runs,
        kv_descs=kv_descs if sent else empty_descs(),
        state=state,
        aux_descs=aux_descs,
    )


def plan_reference(batch: Batch) -> Plan:
    """Plan a whole batch with NumPy; raise a :class:`~kvplan.errors.PlanError` naming the first bad request."""
    if batch.src.req_to_token is None:
        raise InputError(None, "the source side needs its token table (req_to_token)")
    pairings = [pair_sides(batch.src, d) for d in batch.dsts]
    out = []
    for t in batch.transfers:
        if not 0 <= t.dest < len(pairings):
            raise InputError(t.request, f"destination {t.dest} is not one of the batch's {len(pairings)} destinations")
        out.append(_plan_transfer(batch, t, pairings[t.dest], batch.dsts[t.dest]))
    return Plan(tuple(out))
