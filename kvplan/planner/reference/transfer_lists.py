"""One transfer's index lists on the host, with every check of planning.md §2-§6 in order.

:func:`transfer_lists` is the single statement of *what is checked, and in which order* for one
transfer. The reference builds its plan from its result, and the device planner calls it for the
one request its kernels flagged, so both raise the same exception with the same message.

Example::

    lists = transfer_lists(batch, batch.transfers[0])    # raises a PlanError naming the request
    lists.src_pages, lists.dst_pages, lists.state[0]      # paired lists, truncated under `truncate`
"""

from __future__ import annotations

import numpy as np

from ...errors import InputError
from .chunk_lists import TransferLists, last_chunk_lists
from ..contract.batch import Batch, Transfer
from .page_mapping import mapped_lists
from ..contract.rules import check_bounds, check_paged_slots, check_token_table, host, require_both_or_neither, resolve_chunk, token_pages

__all__ = ["TransferLists", "last_chunk_lists", "transfer_lists"]


def transfer_lists(batch: Batch, t: Transfer) -> TransferLists:
    """Resolve and check transfer ``t`` of ``batch``; raise the first error of planning.md §2-§6."""
    if not 0 <= t.dest < len(batch.dsts):
        raise InputError(t.request, f"destination {t.dest} is not one of the batch's {len(batch.dsts)} destinations")
    src, dst, policy, request = batch.src, batch.dsts[t.dest], batch.policy, t.request
    check_token_table(src.req_to_token)
    if dst.kv.page_size != src.kv.page_size:  # docs/page_sizes.md: the rules of its own module
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
