"""Runs and descriptors from paired index lists on the host (planning.md §4, §5).

The formulas every host path shares: the reference builds its plans with them, and the device
planner's :meth:`~kvplan.planner.device.pending.PendingPlan.result` uses them to expand runs into
descriptors when the kernels made none.

Example::

    contiguous_runs(np.array([3, 4, 5, 9]), np.array([10, 11, 12, 13]))   # [[3, 10, 3], [9, 13, 1]]
    direct_descriptors(src_table, dst_table, runs)                         # [entries * runs, 3] uint64
"""

from __future__ import annotations

import numpy as np

from typing import TYPE_CHECKING

from ..contract.pairing import HeadSlice
from ..contract.plan import ComponentPlan, empty_descs, empty_runs
from ..contract.state_kinds import rules_of

if TYPE_CHECKING:
    from ..contract.batch import SideMemory
    from ..contract.pairing import SidePairing
    from .chunk_lists import TransferLists

__all__ = ["component_plans", "contiguous_runs", "scaled_tables", "unit_lists", "direct_descriptors", "head_sliced_descriptors", "unit_runs"]

_U64 = np.uint64


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


def direct_descriptors(src_table: np.ndarray, dst_table: np.ndarray, runs: np.ndarray,
                       nbytes: np.ndarray | None = None) -> np.ndarray:
    """Entry-major descriptors: for each entry pair, for each run (planning.md §5, direct mode).

    ``nbytes``: bytes each entry moves per item when it moves part of an item (sliced entries of
    TP-sliced state, docs/tp_state.md §4; their runs are single items); by default whole items.
    """
    if len(src_table) == 0 or len(runs) == 0:
        return empty_descs()
    per_item = (src_table[:, 1] if nbytes is None else np.asarray(nbytes, _U64))[:, None]
    r = runs.astype(_U64)
    out = np.empty((len(src_table), len(runs), 3), dtype=_U64)
    out[..., 0] = src_table[:, 0][:, None] + r[None, :, 0] * src_table[:, 1][:, None]
    out[..., 1] = dst_table[:, 0][:, None] + r[None, :, 1] * dst_table[:, 1][:, None]
    out[..., 2] = r[None, :, 2] * per_item
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


def position_sliced_descriptors(src_table: np.ndarray, dst_table: np.ndarray, src_slots: np.ndarray,
                                dst_slots: np.ndarray, heads: HeadSlice) -> np.ndarray:
    """One descriptor per entry x position carrying ``heads_sent`` heads, from each side's token slot
    (docs/page_sizes.md §5: head slicing between different page sizes)."""
    if len(src_table) == 0 or len(src_slots) == 0:
        return empty_descs()
    out = np.empty((len(src_table), len(src_slots), 3), dtype=_U64)
    out[..., 0] = (src_table[:, 0][:, None] + src_slots.astype(_U64)[None, :] * _U64(heads.src_token_bytes)
                   + _U64(heads.src_head * heads.bytes_per_head))
    out[..., 1] = (dst_table[:, 0][:, None] + dst_slots.astype(_U64)[None, :] * _U64(heads.dst_token_bytes)
                   + _U64(heads.dst_head * heads.bytes_per_head))
    out[..., 2] = _U64(heads.nbytes)
    return out.reshape(-1, 3)


def unit_runs(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """One run of length 1 per id pair: the runs of a list that never merges (Mamba slots, aux)."""
    src = np.asarray(src, np.int64)
    return np.stack([src, np.asarray(dst, np.int64), np.ones_like(src)], axis=1)


def scaled_tables(src_t: np.ndarray, dst_t: np.ndarray, ps_s: int, ps_d: int) -> tuple[np.ndarray, np.ndarray]:
    """Entry tables ``(base, item)`` whose items are one unit of ``gcd(ps_s, ps_d)`` tokens on each side
    (docs/page_sizes.md §5): pages of ``ps_s`` and ``ps_d`` tokens moved in units."""
    g = np.uint64(np.gcd(ps_s, ps_d))
    src, dst = src_t.copy(), dst_t.copy()
    src[:, 1] = src[:, 1] // _U64(ps_s) * g
    dst[:, 1] = dst[:, 1] // _U64(ps_d) * g
    return src, dst


def unit_lists(src_pages: np.ndarray, dst_pages: np.ndarray, a: int, b: int, ps_s: int, ps_d: int,
               src_from: int | None = None, dst_from: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The units ``(src, dst)`` of positions ``[a, b)`` (multiples of the unit ``g = gcd(ps_s, ps_d)``)
    whose pages are ``src_pages[(pos - src_from) // ps_s]`` and ``dst_pages[(pos - dst_from) // ps_d]``
    (each list starting on a page boundary of its side; both ``from`` default to ``a``)."""
    g = int(np.gcd(ps_s, ps_d))
    src_from = a if src_from is None else src_from
    dst_from = a if dst_from is None else dst_from
    pos = np.arange(a, b, g, dtype=np.int64)
    src = (np.asarray(src_pages, np.int64)[(pos - src_from) // ps_s] * ps_s + (pos - src_from) % ps_s) // g
    dst = (np.asarray(dst_pages, np.int64)[(pos - dst_from) // ps_d] * ps_d + (pos - dst_from) % ps_d) // g
    return src, dst


def component_plans(src: "SideMemory", pairing: "SidePairing", lists: "TransferLists",
                    dst: "SideMemory | None" = None) -> tuple[ComponentPlan, ...]:
    """A last chunk's component plans from its checked lists: runs where the kind merges them
    (else one descriptor per id), descriptors entry-major (planning.md §5, §6).

    A paged component whose pages differ between ``src`` and ``dst`` (docs/page_sizes.md §6) moves
    in units of the gcd of its page sizes, from the later of the two lists' starts: its runs count
    units, its descriptors use unit item lengths, its lists stay in each side's pages.
    """
    out = []
    for c, (comp, (src_list, dst_list), merged) in enumerate(zip(src.state, lists.state, lists.state_runs)):
        cps_s = comp.pages_of(src.kv.page_size)
        cps_d = dst.state[c].pages_of(dst.kv.page_size) if dst is not None else cps_s
        rules = rules_of(comp.kind)
        if rules.paged and cps_s != cps_d:
            g = int(np.gcd(cps_s, cps_d))
            from_s = rules.list_start(comp, cps_s, lists.end, lists.prefix)
            from_d = rules.list_start(comp, cps_d, lists.end, lists.prefix)
            a = max(from_s, from_d)
            moved = min(-(-lists.end // g) * g, from_d + len(dst_list) * cps_d)
            runs = contiguous_runs(*unit_lists(src_list, dst_list, a, moved, cps_s, cps_d, from_s, from_d)) \
                if merged and moved > a else empty_runs()
            descs = direct_descriptors(*scaled_tables(pairing.state_src[c], pairing.state_dst[c], cps_s, cps_d), runs)
            out.append(ComponentPlan(comp.name, comp.kind, src_list, dst_list, runs, descs))
            continue
        heads = pairing.component_heads(c)
        if heads is not None:  # docs/tp_state.md §3: per entry, list position and token
            runs = contiguous_runs(src_list, dst_list) if merged else empty_runs()
            descs = head_sliced_descriptors(pairing.state_src[c], pairing.state_dst[c], src_list, dst_list, heads,
                                            heads.spans_per_page(cps_s)) if merged else empty_descs()
        elif rules_of(comp.kind).forms_runs:
            runs = contiguous_runs(src_list, dst_list) if merged else empty_runs()
            descs = direct_descriptors(pairing.state_src[c], pairing.state_dst[c], runs)
        else:
            runs = empty_runs()
            descs = direct_descriptors(pairing.state_src[c], pairing.state_dst[c], unit_runs(src_list, dst_list),
                                       pairing.component_bytes(c))
        out.append(ComponentPlan(comp.name, comp.kind, src_list, dst_list, runs, descs))
    return tuple(out)
