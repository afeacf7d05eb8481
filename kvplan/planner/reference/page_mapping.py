"""Different page sizes on the two sides (docs/page_sizes.md), on the host: the reference's formulas.

With a source page size ``ps_s`` and a destination page size ``ps_d``, every position maps to a
slot on each side; positions move in units of ``g = gcd(ps_s, ps_d)`` tokens (a unit never
straddles a page on either side), chunks end on multiples of ``G = lcm(ps_s, ps_d)``, and runs
and descriptors are counted in units. With equal page sizes a unit is a page and nothing here is
used: the rules of planning.md apply unchanged.

This covers KV (direct and head-sliced), aux and every state kind: the components whose lists do
not depend on the page size (Mamba, rings, paged state of equal page sizes) as in planning.md §6,
paged state whose pages differ in units (docs/page_sizes.md §6). The device planner implements the
same; only NIXL prepared lists are refused across page sizes. :func:`mapped_lists` is the
one statement of the checks: the reference plans from it, and the device planner's error path and
:func:`~kvplan.planner.reference.transfer_lists.transfer_lists` call it.

Example::

    plan = plan_reference(batch)      # a batch whose source has page size 16, destination 64
    plan.transfers[0].runs            # (s0, d0, len) in units of 16 tokens
"""

from __future__ import annotations

from math import gcd
from typing import TYPE_CHECKING

import numpy as np

from ...errors import AlignmentError, InputError, LengthMismatchError
from .expand import component_plans, contiguous_runs, direct_descriptors, position_sliced_descriptors, scaled_tables, unit_runs
from ..contract.batch import Policy
from ..contract.pairing import Mode
from ..contract.plan import TransferPlan, empty_descs, empty_runs
from ..contract.rules import check_bounds, check_paged_slots, check_row, chunk_end, host, token_pages
from .chunk_lists import TransferLists, last_chunk_lists

if TYPE_CHECKING:
    from ..contract.batch import Batch, Transfer
    from ..contract.pairing import SidePairing

__all__ = ["mapped_lists", "moved_end", "plan_transfer", "unit_tables"]


def unit_tables(pairing: "SidePairing", ps_s: int, ps_d: int) -> tuple[np.ndarray, np.ndarray]:
    """The KV entry tables with the item length of one unit (``g`` tokens) on each side."""
    return scaled_tables(pairing.kv_src, pairing.kv_dst, ps_s, ps_d)


def mapped_lists(batch: "Batch", t: "Transfer") -> TransferLists:
    """Resolve and check transfer ``t`` between sides of different page sizes (docs/page_sizes.md §1-§5).

    The lists are in pages of each side (``dst_pages`` the destination pages the chunk writes, at
    least one unit of each); :func:`moved_end` says where the moved units end.
    """
    src, dst, request, policy = batch.src, batch.dsts[t.dest], t.request, batch.policy
    ps_s, ps_d = src.kv.page_size, dst.kv.page_size
    g = gcd(ps_s, ps_d)
    grain = ps_s * ps_d // g
    if t.prefix_len % grain or t.start % grain or t.start < t.prefix_len:
        raise AlignmentError(request, f"chunk start {t.start} / decode prefix {t.prefix_len} must be multiples of "
                             f"{grain}, the least common multiple of the page sizes {ps_s} and {ps_d}")
    end = chunk_end(t.start, t.fill_len, t.prompt_len, grain, t.last)
    if end < t.start:
        raise InputError(request, f"chunk [{t.start}, {end}) is empty or reversed (fill_len {t.fill_len}, "
                         f"prompt {t.prompt_len})")
    table = host(src.req_to_token)
    check_row(request, table.shape, t.src_row, end)
    if batch.validate:
        check_paged_slots(request, "KV", table[t.src_row, t.start:end].astype(np.int64), t.start, ps_s)
    src_pages = token_pages(table, t.src_row, t.start, end, ps_s)
    check_bounds(request, "KV page", src_pages, 1, src.kv.num_pages)
    moved = -(-end // g) * g  # whole units: the rest of a unit is its page's stale bytes
    first, need = (t.start - t.prefix_len) // ps_d, -(-(moved - t.prefix_len) // ps_d)
    dst_pages = np.asarray(t.dst_pages, np.int64)[first:need]
    what = f"chunk [{t.start}, {end}) KV pages"
    if len(dst_pages) < need - first and policy is Policy.STRICT:
        raise LengthMismatchError(request, f"{what}: {need - first} destination pages of {ps_d} tokens needed, "
                                  f"{len(dst_pages)} left")
    check_bounds(request, "destination KV page", dst_pages, 1, dst.kv.num_pages)
    last = first + len(dst_pages) >= len(t.dst_pages)
    if last != t.last and policy is Policy.STRICT:
        raise LengthMismatchError(request, f"{what}: the scheduler says last={t.last} but the destination pages say "
                                  f"last={last} ({first} + {len(dst_pages)} of {len(t.dst_pages)})")
    units = moved_end(t, end, len(dst_pages), ps_d, g) > t.start
    state, state_runs, aux = last_chunk_lists(batch, t) if last else ((), (), False)  # §6: paired as they are
    return TransferLists(end, last, last or units, src_pages, dst_pages, units, state, state_runs, aux, t.prefix_len)


def moved_end(t: "Transfer", end: int, dst_count: int, ps_d: int, g: int) -> int:
    """Where a chunk's moved units end: ``end`` rounded up to a unit, cut to its ``dst_count`` pages."""
    first = (t.start - t.prefix_len) // ps_d
    return min(-(-end // g) * g, t.prefix_len + (first + dst_count) * ps_d)


def plan_transfer(batch: "Batch", t: "Transfer", pairing: "SidePairing") -> TransferPlan:
    """One transfer between sides of different page sizes (docs/page_sizes.md §1-§5)."""
    src, dst = batch.src, batch.dsts[t.dest]
    ps_s, ps_d = src.kv.page_size, dst.kv.page_size
    g = gcd(ps_s, ps_d)
    lists = mapped_lists(batch, t)
    src_pages, dst_pages, end = lists.src_pages, lists.dst_pages, lists.end
    first = (t.start - t.prefix_len) // ps_d
    moved = moved_end(t, end, len(dst_pages), ps_d, g)
    pos = np.arange(t.start, moved, g, dtype=np.int64)
    src_page_of = src_pages[(pos - t.start) // ps_s] if len(pos) else pos
    src_units = (src_page_of * ps_s + pos % ps_s) // g
    dst_units = (dst_pages[(pos - t.prefix_len) // ps_d - first] * ps_d + (pos - t.prefix_len) % ps_d) // g
    runs = contiguous_runs(src_units, dst_units) if len(pos) else empty_runs()
    if not lists.sent:
        kv_descs = empty_descs()
    elif pairing.mode is Mode.DIRECT:
        kv_descs = direct_descriptors(*unit_tables(pairing, ps_s, ps_d), runs)
    else:
        every = np.arange(t.start, moved, dtype=np.int64)  # one descriptor per entry and position
        src_slots = src_pages[(every - t.start) // ps_s] * ps_s + every % ps_s
        dst_slots = dst_pages[(every - t.prefix_len) // ps_d - first] * ps_d + (every - t.prefix_len) % ps_d
        kv_descs = position_sliced_descriptors(pairing.kv_src, pairing.kv_dst, src_slots, dst_slots, pairing.heads)
    aux_descs = direct_descriptors(pairing.aux_src, pairing.aux_dst, unit_runs([t.aux_src], [t.aux_dst])) \
        if lists.aux else empty_descs()
    return TransferPlan(request=t.request, dest=t.dest, mode=pairing.mode, start=t.start, end=end, last=lists.last,
                        sent=lists.sent, src_pages=src_pages, dst_pages=dst_pages, runs=runs, kv_descs=kv_descs,
                        state=component_plans(src, pairing, lists, dst), aux_descs=aux_descs)
