"""The "SGLang-style" baseline of benchmarks.md, written by us from planning.md.

For each transfer, one after another: ``.cpu().numpy()`` of the token slice, page ids in NumPy,
runs with NumPy (``diff``/``where``/``split``/``.tolist()``), then a Python loop that builds
``(src, dst, len)`` per entry x run and the three lists Mooncake's batch call takes. Direct mode,
KV and aux (the scenarios it is measured on have no state components).
"""

from __future__ import annotations

import numpy as np

from kvplan.compat.sglang import group_concurrent_contiguous, kv_to_page_indices
from kvplan.planner.model import Batch
from kvplan.planner.pairing import pair_sides
from kvplan.planner.reference import chunk_end


def sglang_style_plan(batch: Batch) -> tuple[list[int], list[int], list[int]]:
    """Mooncake's three lists (source addresses, destination addresses, lengths) for the batch."""
    src_side = batch.src
    table = src_side.req_to_token
    ps = src_side.kv.page_size
    pairings = [pair_sides(src_side, d) for d in batch.dsts]
    src_addrs: list[int] = []
    dst_addrs: list[int] = []
    lengths: list[int] = []
    for t in batch.transfers:
        pairing = pairings[t.dest]
        end = chunk_end(t.start, t.fill_len, t.prompt_len, ps, t.last)
        kv_indices = table[t.src_row, t.start:end].cpu().numpy()
        pages = kv_to_page_indices(kv_indices, ps).astype(np.int64)
        cursor = (t.start - t.prefix_len) // ps
        dst_pages = t.dst_pages[cursor : cursor + len(pages)]
        src_groups, dst_groups = group_concurrent_contiguous(pages, dst_pages)
        for (sb, item), (db, _) in zip(pairing.kv_src.tolist(), pairing.kv_dst.tolist()):
            for sg, dg in zip(src_groups, dst_groups):
                src_addrs.append(sb + sg[0] * item)
                dst_addrs.append(db + dg[0] * item)
                lengths.append(item * len(sg))
        last = cursor + len(dst_pages) >= len(t.dst_pages)
        if last:
            for (sb, item), (db, _) in zip(pairing.aux_src.tolist(), pairing.aux_dst.tolist()):
                src_addrs.append(sb + t.aux_src * item)
                dst_addrs.append(db + t.aux_dst * item)
                lengths.append(item)
    return src_addrs, dst_addrs, lengths


def sglang_style_descs(batch: Batch) -> np.ndarray:
    """The baseline's descriptors as the Nx3 uint64 array NIXL takes."""
    s, d, n = sglang_style_plan(batch)
    return np.array([s, d, n], dtype=np.uint64).T.copy()
