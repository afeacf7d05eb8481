"""The NumPy reference planner: planning.md, written to be slow and obviously right.

Every kernel of kvplan is compared against this module; nothing on the device path imports it.
It walks the batch one transfer at a time: :func:`~kvplan.planner.reference.transfer_lists.transfer_lists`
resolves and checks the transfer's lists (the shared rules of :mod:`kvplan.planner.contract.rules` and the
kinds of :mod:`kvplan.planner.contract.state_kinds`), then runs and descriptors follow by the host
formulas of :mod:`kvplan.planner.reference.expand`.

Example::

    from kvplan.planner.reference.oracle import plan_reference
    plan = plan_reference(batch)           # batch: kvplan.planner.contract.batch.Batch
    descs, offsets = plan.descriptors()    # [n, 3] uint64, [transfers + 1]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import AlignmentError, InputError
from . import page_mapping
from ..contract.claims import Claims, check_claims
from .expand import component_plans, contiguous_runs, direct_descriptors, head_sliced_descriptors, unit_runs
from ..contract.batch import Batch, SideMemory, Transfer
from ..contract.pairing import Mode, SidePairing, pair_sides
from ..contract.plan import DestinationLists, Plan, TransferPlan, empty_descs, empty_runs
from ..contract.rules import check_bounds, check_paged_slots, check_row, check_token_table, chunk_end, host, token_pages
from ..contract.state_kinds import state_list
from .transfer_lists import transfer_lists

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


def destination_lists(
    side: SideMemory, row: int, prefix_len: int, prompt_len: int, request: Any = None, validate: bool = True
) -> DestinationLists:
    """The decode side's lists for a pre-allocated request (planning.md §3, §6)."""
    ps = side.kv.page_size
    if prefix_len % ps:
        raise AlignmentError(request, f"decode prefix {prefix_len} is not a multiple of page size {ps}")
    check_token_table(side.req_to_token)
    table = host(side.req_to_token)
    check_row(request, table.shape, row, prompt_len)
    if validate:
        check_paged_slots(request, "KV", table[row, prefix_len:prompt_len].astype(np.int64), prefix_len, ps)
    pages = token_pages(table, row, prefix_len, prompt_len, ps)
    check_bounds(request, "KV page", pages, 1, side.kv.num_pages)
    state = tuple(state_list(side, c, row, prompt_len, request, validate=validate, prefix=prefix_len)
                  for c in side.state)
    return DestinationLists(pages, state)


def _plan_transfer(batch: Batch, t: Transfer, pairing: SidePairing) -> TransferPlan:
    lists = transfer_lists(batch, t)
    src_pages, dst_pages = lists.src_pages, lists.dst_pages
    runs = contiguous_runs(src_pages, dst_pages) if lists.kv_runs else empty_runs()
    if not lists.sent:
        kv_descs = empty_descs()
    elif pairing.mode is Mode.DIRECT:
        kv_descs = direct_descriptors(pairing.kv_src, pairing.kv_dst, runs)
    else:
        kv_descs = head_sliced_descriptors(pairing.kv_src, pairing.kv_dst, src_pages, dst_pages, pairing.heads,
                                           pairing.heads.spans_per_page(batch.src.kv.page_size))
    state = component_plans(batch.src, pairing, lists, batch.dsts[t.dest])
    aux_descs = empty_descs()
    if lists.aux:
        aux_descs = direct_descriptors(pairing.aux_src, pairing.aux_dst, unit_runs([t.aux_src], [t.aux_dst]))
    return TransferPlan(
        request=t.request,
        dest=t.dest,
        mode=pairing.mode,
        start=t.start,
        end=lists.end,
        last=lists.last,
        sent=lists.sent,
        src_pages=src_pages,
        dst_pages=dst_pages,
        runs=runs,
        kv_descs=kv_descs,
        state=state,
        aux_descs=aux_descs,
    )


def plan_reference(batch: Batch) -> Plan:
    """Plan a whole batch with NumPy; raise a :class:`~kvplan.errors.PlanError` naming the first bad request.

    Every transfer is checked first, in batch order; then no two of them may write one destination
    item (:mod:`kvplan.planner.contract.claims`).
    """
    check_token_table(batch.src.req_to_token)
    pairings = [pair_sides(batch.src, d) for d in batch.dsts]
    out = []
    for t in batch.transfers:
        if not 0 <= t.dest < len(pairings):
            raise InputError(t.request, f"destination {t.dest} is not one of the batch's {len(pairings)} destinations")
        if batch.dsts[t.dest].kv.page_size != batch.src.kv.page_size:
            out.append(page_mapping.plan_transfer(batch, t, pairings[t.dest]))  # docs/page_sizes.md
        else:
            out.append(_plan_transfer(batch, t, pairings[t.dest]))
    check_claims([Claims.of_plan(t, p) for t, p in zip(batch.transfers, out)], [c.name for c in batch.src.state])
    return Plan(tuple(out))
