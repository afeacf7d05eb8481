"""One transfer's index lists on the host, with every check of planning.md §2-§6 in order.

:func:`transfer_lists` is the single statement of *what is checked, and in which order* for one
transfer. The reference builds its plan from its result, and the device planner calls it for the
one request its kernels flagged, so both raise the same exception with the same message.

Example::

    lists = transfer_lists(batch, batch.transfers[0])    # raises a PlanError naming the request
    lists.src_pages, lists.dst_pages, lists.state[0]      # paired lists, truncated under `truncate`
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

import numpy as np

from ..errors import InputError, LengthMismatchError
from .model import Batch, Transfer
from .rules import cdiv, check_aux, check_bounds, check_paged_slots, check_token_table, host, paired_length, \
    require_both_or_neither, resolve_chunk, token_pages
from .state_kinds import rules_of, state_list

__all__ = ["TransferLists", "last_chunk_lists", "transfer_lists"]


@dataclass(frozen=True)
class TransferLists:
    """The checked lists of one transfer.

    ``kv_runs`` / ``state_runs[c]`` say whether the paired lists form runs (both sides non-empty,
    the component merges); ``state`` is empty unless the chunk is the last one.
    """

    end: int
    last: bool
    sent: bool
    src_pages: np.ndarray
    dst_pages: np.ndarray
    kv_runs: bool
    state: tuple[tuple[np.ndarray, np.ndarray], ...]
    state_runs: tuple[bool, ...]
    aux: bool
    prefix: int = 0  # the decode prefix P: where a ``from_prefix`` component's lists start at the earliest


def transfer_lists(batch: Batch, t: Transfer) -> TransferLists:
    """Resolve and check transfer ``t`` of ``batch``; raise the first error of planning.md §2-§6."""
    if not 0 <= t.dest < len(batch.dsts):
        raise InputError(t.request, f"destination {t.dest} is not one of the batch's {len(batch.dsts)} destinations")
    src, dst, policy, request = batch.src, batch.dsts[t.dest], batch.policy, t.request
    check_token_table(src.req_to_token)
    if dst.kv.page_size != src.kv.page_size:  # docs/page_sizes.md: the rules of its own module
        from .page_mapping import mapped_lists

        return mapped_lists(batch, t)
    ps = src.kv.page_size
    table = host(src.req_to_token)
    chunk = resolve_chunk(t, ps, table.shape, dst.kv.num_pages, policy)
    end = chunk.end
    if batch.validate:
        check_paged_slots(request, "KV", table[t.src_row, t.start:end].astype(np.int64), t.start, ps)
    src_pages = token_pages(table, t.src_row, t.start, end, ps)
    check_bounds(request, "KV page", src_pages, 1, src.kv.num_pages)
    src_pages = src_pages[: chunk.pages]
    kv_runs = chunk.sent and require_both_or_neither(request, f"chunk [{t.start}, {end}) KV pages",
                                                     len(src_pages), len(chunk.dst_pages), policy)
    state, state_runs, aux = last_chunk_lists(batch, t) if chunk.last else ((), (), False)
    return TransferLists(end, chunk.last, chunk.sent, src_pages, chunk.dst_pages, kv_runs, state, state_runs, aux,
                         t.prefix_len)


def last_chunk_lists(batch: Batch, t: Transfer) -> tuple[tuple[tuple[np.ndarray, np.ndarray], ...],
                                                         tuple[bool, ...], bool]:
    """A last chunk's state lists (paired, checked, truncated under ``truncate``), whether each forms
    runs, and whether it carries aux rows (planning.md §6)."""
    src, dst, policy, request = batch.src, batch.dsts[t.dest], batch.policy, t.request
    seq = min(t.fill_len, t.prompt_len)
    if len(t.dst_state) != len(src.state):
        raise LengthMismatchError(
            request, f"{len(src.state)} state components on the source, {len(t.dst_state)} destination lists"
        )
    state: list[tuple[np.ndarray, np.ndarray]] = []
    state_runs: list[bool] = []
    for comp, dst_comp, dst_list in zip(src.state, dst.state, t.dst_state):
        rules = rules_of(comp.kind)
        what = f"state component {comp.name}"
        src_list = state_list(src, comp, t.src_row, seq, request, policy, batch.validate, t.prefix_len)
        cps_s, cps_d = comp.pages_of(src.kv.page_size), dst_comp.pages_of(dst.kv.page_size)
        if rules.paged and cps_s != cps_d:  # docs/page_sizes.md §6: in units, each side's pages
            unit = gcd(cps_s, cps_d)
            from_s = rules.list_start(comp, cps_s, seq, t.prefix_len)
            from_d = rules.list_start(comp, cps_d, seq, t.prefix_len)
            n = paired_length(request, what, cdiv(seq - from_d, cps_d), len(dst_list), policy, rules.always_strict)
            moved = min(cdiv(seq, unit) * unit, from_d + n * cps_d)
            state.append((src_list[: cdiv(moved - from_s, cps_s)], dst_list[:n]))
        else:
            n = paired_length(request, what, len(src_list), len(dst_list), policy, rules.always_strict)
            state.append((src_list[:n], dst_list[:n]))
        state_runs.append(rules.forms_runs and require_both_or_neither(request, what, n, n, policy))
    for (_, dst_list), comp in zip(state, dst.state):
        check_bounds(request, f"destination {comp.name}", dst_list, 0, comp.num_items)
    return tuple(state), tuple(state_runs), check_aux(t, src, dst)
