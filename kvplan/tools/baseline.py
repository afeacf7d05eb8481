"""The "SGLang-style" planning path of benchmarks.md, written by us from planning.md.

This is what kvplan is measured against: for each transfer, one after another, ``.cpu().numpy()``
of the token slice; page ids in NumPy; SWA translation as a device gather then ``.cpu()``; runs
with NumPy (``diff``/``where``/``split``/``.tolist()``); then a Python loop that builds
``(src, dst, len)`` per entry x run, collected into the three lists Mooncake's batch call takes.
Direct mode with every state type and aux, and head-sliced mode (per entry, NumPy over pages and
tokens, then Python lists), on valid input (it validates nothing, as SGLang).

Example::

    src_addrs, dst_addrs, lengths = sglang_style_plan(batch)
"""

from __future__ import annotations

import numpy as np
import torch

from ..compat.sglang import group_concurrent_contiguous, kv_to_page_indices
from ..errors import LayoutError
from ..planner.contract.batch import Batch, StateKind
from ..planner.contract.pairing import Mode, pair_sides
from ..planner.contract.rules import chunk_end

__all__ = ["sglang_style_descs", "sglang_style_plan"]


def _as_tensor(values):
    return values if isinstance(values, torch.Tensor) else torch.from_numpy(np.asarray(values))


def sglang_style_plan(batch: Batch) -> tuple[list[int], list[int], list[int]]:
    """Mooncake's three lists (source addresses, destination addresses, lengths) for the batch."""
    src_side = batch.src
    table = _as_tensor(src_side.req_to_token)
    ps = src_side.kv.page_size
    pairings = [pair_sides(src_side, d) for d in batch.dsts]
    if any(d.kv.page_size != src_side.kv.page_size for d in batch.dsts):
        raise LayoutError("the SGLang-style baseline plans equal page sizes only (SGLang refuses a mismatch)")
    src_addrs: list[int] = []
    dst_addrs: list[int] = []
    lengths: list[int] = []

    def emit(src_table, dst_table, src_groups, dst_groups):
        for (sb, item), (db, _) in zip(src_table.tolist(), dst_table.tolist()):
            for sg, dg in zip(src_groups, dst_groups):
                src_addrs.append(sb + sg[0] * item)
                dst_addrs.append(db + dg[0] * item)
                lengths.append(item * len(sg))

    def emit_sliced(src_table, dst_table, src_ids, dst_ids, h, per):
        """SGLang's head-sliced path (``send_kvcache_slice``, ``_send_swa_state_slice``): one block
        per entry, id and token."""
        tokens = np.arange(per, dtype=np.int64)
        for (sb, s_item), (db, d_item) in zip(src_table.tolist(), dst_table.tolist()):
            s_addr = sb + src_ids[:, None] * s_item + tokens[None, :] * h.src_token_bytes + h.src_head * h.bytes_per_head
            d_addr = db + dst_ids[:, None] * d_item + tokens[None, :] * h.dst_token_bytes + h.dst_head * h.bytes_per_head
            src_addrs.extend(s_addr.reshape(-1).tolist())
            dst_addrs.extend(d_addr.reshape(-1).tolist())
            lengths.extend([h.nbytes] * s_addr.size)

    for t in batch.transfers:
        pairing = pairings[t.dest]
        end = chunk_end(t.start, t.fill_len, t.prompt_len, ps, t.last)
        kv_indices = table[t.src_row, t.start:end].cpu().numpy()
        pages = kv_to_page_indices(kv_indices, ps).astype(np.int64)
        cursor = (t.start - t.prefix_len) // ps
        dst_pages = t.dst_pages[cursor : cursor + len(pages)]
        if pairing.mode is Mode.HEAD_SLICED:
            emit_sliced(pairing.kv_src, pairing.kv_dst, pages, np.asarray(dst_pages, np.int64), pairing.heads, ps)
        else:
            emit(pairing.kv_src, pairing.kv_dst, *group_concurrent_contiguous(pages, dst_pages))
        if cursor + len(dst_pages) < len(t.dst_pages):
            continue
        seq = min(t.fill_len, t.prompt_len)
        for c, comp in enumerate(src_side.state):
            cps = comp.pages_of(ps)
            floor = t.prefix_len if comp.from_prefix else 0  # SGLang 0.5.23 starts at the decode prefix
            if comp.kind is StateKind.SWA:
                ws = (max(floor, seq - comp.window) // cps) * cps
                swa = _as_tensor(comp.slot_map)[table[t.src_row, ws:seq].long()].cpu().numpy()
                src_list = kv_to_page_indices(swa, cps).astype(np.int64)
            elif comp.kind is StateKind.DSA:
                src_list = kv_to_page_indices(table[t.src_row, floor:seq].cpu().numpy(), cps).astype(np.int64)
            elif comp.kind is StateKind.SWA_RING:
                lo = max(0, seq - comp.window)
                src_list = t.src_row * comp.ring_size + np.arange(lo, seq) % comp.ring_size
            elif comp.kind is StateKind.MAMBA:
                src_list = np.array([int(_as_tensor(comp.slot_map)[t.src_row])], dtype=np.int64)
            else:
                raise LayoutError(f"the sglang-loop baseline has no formula for state kind {comp.kind.value}")
            dst_list = t.dst_state[c]
            n = min(len(src_list), len(dst_list))
            if pairing.component_heads(c) is not None:  # SWA between TP sizes (docs/tp_state.md)
                emit_sliced(pairing.state_src[c], pairing.state_dst[c], np.asarray(src_list[:n], np.int64),
                            np.asarray(dst_list[:n], np.int64), pairing.component_heads(c), cps)
                continue
            per_item = pairing.component_bytes(c)
            if per_item is not None:  # Mamba between TP sizes: SGLang's _send_mamba_state_slice blocks
                for (sb, s_item), (db, d_item), nbytes in zip(pairing.state_src[c].tolist(),
                                                              pairing.state_dst[c].tolist(), per_item.tolist()):
                    for s_id, d_id in zip(src_list[:n].tolist(), dst_list[:n].tolist()):
                        src_addrs.append(sb + s_id * s_item)
                        dst_addrs.append(db + d_id * d_item)
                        lengths.append(nbytes)
                continue
            if comp.kind is StateKind.MAMBA:
                groups = ([[int(x)] for x in src_list[:n]], [[int(x)] for x in dst_list[:n]])
            else:
                groups = group_concurrent_contiguous(src_list[:n], dst_list[:n])
            emit(pairing.state_src[c], pairing.state_dst[c], *groups)
        for (sb, item), (db, _) in zip(pairing.aux_src.tolist(), pairing.aux_dst.tolist()):
            src_addrs.append(sb + t.aux_src * item)
            dst_addrs.append(db + t.aux_dst * item)
            lengths.append(item)
    return src_addrs, dst_addrs, lengths


def sglang_style_descs(batch: Batch) -> np.ndarray:
    """The baseline's descriptors as the Nx3 uint64 array NIXL takes."""
    s, d, n = sglang_style_plan(batch)
    return np.array([s, d, n], dtype=np.uint64).reshape(3, -1).T.copy()
