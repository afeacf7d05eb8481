"""What one transfer's lists are once resolved (:class:`TransferLists`), and a last chunk's state
lists: shared by the two resolutions (:mod:`.transfer_lists` for equal page sizes,
:mod:`.page_mapping` for different ones), which import it; it imports neither.

Example::

    state, state_runs, aux = last_chunk_lists(batch, transfer)   # a last chunk's state lists, checked
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

import numpy as np

from ...errors import LengthMismatchError
from ..contract.batch import Batch, Transfer
from ..contract.rules import cdiv, check_aux, check_bounds, paired_length, require_both_or_neither
from ..contract.state_kinds import rules_of, state_list

__all__ = ["TransferLists", "last_chunk_lists"]


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
