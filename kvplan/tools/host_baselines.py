"""The strongest host planners we can write, for benchmarks.md's ``numpy-batch`` and ``prepared-ids``.

Both take their inputs where kvplan takes them (token table and slot maps on the device, the
batch's columns on the host), so their time includes the copy of what they need to the host.
They validate nothing (valid batches only) and produce exactly kvplan's outputs, which the
benchmark checks before it times anything.

* :class:`NumpyBatchPlanner`: the whole batch at once. One gather of the rows used (and, for SWA,
  their translated slots; for Mamba, their slots) to the host; every list by one fancy index per
  state kind; run breaks by ``diff``/``flatnonzero`` over all lists at once, with breaks at
  segment ends; descriptors as a broadcast of entries x runs (or entries x pages x tokens, for KV
  and SWA state between TP sizes) into a
  reused buffer, one NumPy expression per segment, optionally spread over a thread pool.
* :func:`prepared_ids`: what SGLang's NIXL path and vLLM's NIXL connector do: per request, NumPy
  page ids, then ``entry * num_slots + id`` as int32, no run merging.

Example::

    planner = NumpyBatchPlanner(batch.src, batch.dsts, threads=8)
    descs, offsets = planner.plan(BatchColumns.from_batch(batch))
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch

from ..errors import LayoutError
from ..planner.device.columns import COLUMNS, BatchColumns
from ..planner.contract.batch import SideMemory, StateKind
from ..planner.reference.expand import scaled_tables
from ..planner.reference.page_mapping import unit_tables
from ..planner.contract.pairing import Mode, SidePairing, pair_sides
from ..planner.device.prepared import prepared_slots

__all__ = ["HostLists", "NumpyBatchPlanner", "host_lists", "prepared_ids"]

_U64 = np.uint64


class HostLists:
    """Every list of a batch on the host, in segment order (transfer-major: KV, components, aux)."""

    def __init__(self, src: np.ndarray, dst: np.ndarray, seg_n: np.ndarray, merge: np.ndarray, K: int):
        self.src, self.dst, self.seg_n, self.merge, self.K = src, dst, seg_n, merge, K
        self.seg_off = np.cumsum(seg_n) - seg_n


def _ranges(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For lists of ``counts`` elements: the owner and the local index of every element."""
    owner = np.repeat(np.arange(len(counts)), counts)
    local = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, local


def host_lists(src: SideMemory, columns: BatchColumns, dst_page_size: int | None = None,
               dst_comp_pages: Sequence[int] | None = None) -> tuple[HostLists, np.ndarray, np.ndarray]:
    """``(lists, last, sent)``: one device gather of the rows used, then NumPy over the whole batch.

    With ``dst_page_size`` other than the source's, KV lists are in units of their gcd tokens
    (docs/page_sizes.md): chunks end on the lcm, destination unit ``k`` of a chunk lies in its
    ``k // rd``-th page. ``dst_comp_pages``: each component's destination page size; a DSA
    component whose pages differ moves in units the same way.
    """
    c = dict(zip(COLUMNS, columns.table.T))
    ps, C = src.kv.page_size, len(src.state)
    K, T = 2 + C, columns.num_transfers
    table = src.req_to_token
    rows = c["src_row"]
    unique, inv = np.unique(rows, return_inverse=True)
    index = torch.from_numpy(unique).to(table.device, non_blocking=True)
    gathered = table.index_select(0, index)
    host_rows = gathered.cpu().numpy()
    mapped_rows = {k: comp.slot_map[gathered.long()].cpu().numpy() for k, comp in enumerate(src.state)
                   if comp.kind is StateKind.SWA}
    mamba = {k: comp.slot_map[index].cpu().numpy() for k, comp in enumerate(src.state) if comp.kind is StateKind.MAMBA}
    seq = np.minimum(c["fill_len"], c["prompt_len"])
    pd = dst_page_size or ps
    unit = math.gcd(ps, pd)
    grain = ps * pd // unit
    end = np.where(c["last"] != 0, seq, np.maximum(c["start"], seq // grain * grain))
    cursor = (c["start"] - c["prefix_len"]) // pd
    moved = -(-end // unit) * unit
    pages = np.minimum(-(-(moved - c["prefix_len"]) // pd) - cursor, c["kv_len"] - cursor)
    last = cursor + pages >= c["kv_len"]
    moved = np.minimum(moved, c["prefix_len"] + (cursor + pages) * pd)
    n = np.maximum(moved - c["start"], 0) // unit
    sent = last | (n > 0)
    rd = pd // unit
    counts = np.zeros((T, K), np.int64)
    merge = np.ones(K, bool)
    parts: list[tuple[np.ndarray, np.ndarray]] = []

    counts[:, 0] = np.where(sent, n, 0)
    t, k = _ranges(counts[:, 0])
    if rd == 1 and unit == ps:
        parts.append((host_rows[inv[t], c["start"][t] + k * ps].astype(np.int64) // ps,
                      columns.dst_flat[c["kv_lo"][t] + cursor[t] + k]))
    else:
        parts.append((host_rows[inv[t], c["start"][t] + k * unit].astype(np.int64) // unit,
                      columns.dst_flat[c["kv_lo"][t] + cursor[t] + k // rd] * rd + k % rd))
    lasts = np.flatnonzero(last)
    for j, comp in enumerate(src.state):
        lo_col, len_col = columns.table[lasts, len(COLUMNS) + 2 * j], columns.table[lasts, len(COLUMNS) + 2 * j + 1]
        cps = comp.pages_of(ps)
        cps_d = dst_comp_pages[j] if dst_comp_pages is not None else cps
        floor = c["prefix_len"][lasts] if comp.from_prefix else 0 * lo_col  # planning.md §6's prefix variant
        if comp.kind in (StateKind.DSA, StateKind.SWA) and cps_d != cps:  # in units of gcd tokens
            cu, r, s = math.gcd(cps, cps_d), cps_d // math.gcd(cps, cps_d), seq[lasts]
            swa = comp.kind is StateKind.SWA
            from_s = np.maximum(s - comp.window, floor) // cps * cps if swa else floor
            from_d = np.maximum(s - comp.window, floor) // cps_d * cps_d if swa else floor
            a = np.maximum(from_s, from_d)
            moved = np.minimum(-(-s // cu) * cu, from_d + len_col * cps_d)
            units = np.maximum(moved - a, 0) // cu
            counts[lasts, 1 + j] = units
            t, k = _ranges(units)
            owner, kk = lasts[t], k + ((a - from_d) // cu)[t]
            slots = (mapped_rows[j] if swa else host_rows)[inv[owner], a[t] + k * cu]
            parts.append((slots.astype(np.int64) // cu, columns.dst_flat[lo_col[t] + kk // r] * r + kk % r))
            continue
        counts[lasts, 1 + j] = len_col
        t, k = _ranges(len_col)
        owner = lasts[t]
        s = seq[owner]
        if comp.kind is StateKind.SWA:
            ws = np.maximum(s - comp.window, floor[t]) // cps * cps
            ids = mapped_rows[j][inv[owner], ws + k * cps] // cps
        elif comp.kind is StateKind.DSA:
            ids = host_rows[inv[owner], floor[t] + k * cps].astype(np.int64) // cps
        elif comp.kind is StateKind.SWA_RING:
            ids = rows[owner] * comp.ring_size + (np.maximum(s - comp.window, 0) + k) % comp.ring_size
        elif comp.kind is StateKind.MAMBA:
            ids = mamba[j][inv[owner]]
            merge[1 + j] = False
        else:
            raise LayoutError(f"the numpy-batch baseline has no formula for state kind {comp.kind.value}")
        parts.append((ids.astype(np.int64), columns.dst_flat[lo_col[t] + k]))
    merge[K - 1] = False
    if src.aux:
        counts[lasts, K - 1] = 1
        parts.append((c["aux_src"][lasts], c["aux_dst"][lasts]))
    else:
        parts.append((np.zeros(0, np.int64), np.zeros(0, np.int64)))
    seg_n = counts.reshape(-1)
    out_src, out_dst = np.empty(int(seg_n.sum()), np.int64), np.empty(int(seg_n.sum()), np.int64)
    seg_off = np.cumsum(seg_n) - seg_n
    for slot, (ids, dst) in enumerate(parts):
        owners = np.flatnonzero(counts[:, slot])
        t, k = _ranges(counts[owners, slot])
        at = seg_off[owners[t] * K + slot] + k
        out_src[at], out_dst[at] = ids, dst
    return HostLists(out_src, out_dst, seg_n, np.tile(merge, T), K), last, sent


class NumpyBatchPlanner:
    """``numpy-batch``: the whole batch planned with NumPy (see the module docstring)."""

    def __init__(self, src: SideMemory, dsts: Sequence[SideMemory], threads: int = 1):
        self.src, self.dsts = src, tuple(dsts)
        self.pairings: list[SidePairing] = [pair_sides(src, d) for d in self.dsts]
        sizes = {d.kv.page_size for d in self.dsts}
        if len(sizes) > 1:
            raise LayoutError("numpy-batch plans destinations of one page size at a time")
        self.dst_page_size = sizes.pop() if sizes else src.kv.page_size
        if self.dst_page_size != src.kv.page_size and any(p.mode is not Mode.DIRECT for p in self.pairings):
            raise LayoutError("numpy-batch plans different page sizes for direct KV only")
        self.comp_pages = [c.pages_of(self.dst_page_size) for c in self.dsts[0].state] if self.dsts else []
        self.pool = ThreadPoolExecutor(threads) if threads > 1 else None
        self.threads = threads
        self.out = np.empty((0, 3), _U64)
        self._items: dict[tuple[int, int], np.uint64 | None] = {}
        # per destination and slot: (head slice, tokens per element) where it is head-sliced (KV between
        # TP sizes, and SWA state with it: docs/tp_state.md), else None
        ps = src.kv.page_size
        self.slices = [[(p.heads, ps) if p.mode is Mode.HEAD_SLICED else None]
                       + [(p.component_heads(c), comp.pages_of(ps)) if p.component_heads(c) is not None else None
                          for c, comp in enumerate(src.state)] + [None] for p in self.pairings]
        self._sliced_tokens = np.array([[sl[1] if sl else 0 for sl in row] for row in self.slices], np.int64) \
            if self.slices else np.zeros((0, 2 + len(src.state)), np.int64)

    def _tables(self, d: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
        p, K = self.pairings[d], 2 + len(self.src.state)
        if slot == 0:
            if self.dst_page_size != self.src.kv.page_size:  # units of gcd tokens (docs/page_sizes.md)
                return unit_tables(p, self.src.kv.page_size, self.dst_page_size)
            return p.kv_src, p.kv_dst
        if slot == K - 1:
            return p.aux_src, p.aux_dst
        comp = self.src.state[slot - 1]
        cps_s, cps_d = comp.pages_of(self.src.kv.page_size), self.comp_pages[slot - 1]
        if comp.kind in (StateKind.DSA, StateKind.SWA) and cps_s != cps_d:  # in units (docs/page_sizes.md §6)
            return scaled_tables(p.state_src[slot - 1], p.state_dst[slot - 1], cps_s, cps_d)
        return p.state_src[slot - 1], p.state_dst[slot - 1]

    def _per_item(self, d: int, slot: int) -> np.ndarray | None:
        """Bytes per item of a slot's sliced entries (TP-sliced Mamba state), else None (whole items)."""
        K = 2 + len(self.src.state)
        return self.pairings[d].component_bytes(slot - 1) if 0 < slot < K - 1 else None

    def _uniform_item(self, d: int, slot: int) -> np.uint64 | None:
        """The item length shared by every source entry of ``(d, slot)``, or ``None``."""
        key = (d, slot)
        if key not in self._items:
            items = np.unique(self._tables(d, slot)[0][:, 1])
            whole = self._per_item(d, slot) is None
            self._items[key] = _U64(items[0]) if len(items) == 1 and whole else None
        return self._items[key]

    def runs(self, columns: BatchColumns) -> tuple[np.ndarray, np.ndarray, HostLists, np.ndarray, np.ndarray]:
        """The compact runs form: ``(runs [R, 3] (s0, d0, len), runs per segment, lists, run starts, lengths)``."""
        lists, _, _ = host_lists(self.src, columns, self.dst_page_size, self.comp_pages)
        src, dst, seg_n, seg_off = lists.src, lists.dst, lists.seg_n, lists.seg_off
        total = len(src)
        brk = np.ones(total, bool)
        if total > 1:
            brk[1:] = (np.diff(src) != 1) | (np.diff(dst) != 1)
        brk[seg_off[seg_n > 0]] = True
        seg_of = np.repeat(np.arange(len(seg_n)), seg_n)
        brk |= ~lists.merge[seg_of]
        starts = np.flatnonzero(brk)
        lens = np.diff(np.append(starts, total))
        seg_runs = np.bincount(seg_of[starts], minlength=len(seg_n))
        return np.stack([src[starts], dst[starts], lens], axis=1), seg_runs, lists, starts, lens

    def plan(self, columns: BatchColumns) -> tuple[np.ndarray, np.ndarray]:
        """``(descs [n, 3] uint64, per-transfer offsets [T + 1])``, equal to kvplan's."""
        _, seg_runs, lists, starts, lens = self.runs(columns)
        K = lists.K
        src, dst, seg_n, seg_off = lists.src, lists.dst, lists.seg_n, lists.seg_off
        run_off = np.cumsum(seg_runs) - seg_runs
        dest = columns.column("dest")
        seg_dest = np.repeat(dest, K)
        tokens = self._sliced_tokens[seg_dest, np.arange(len(seg_n)) % K]
        sliced = tokens > 0
        entries = np.array([[len(self._tables(d, k)[0]) for k in range(K)] for d in range(len(self.dsts))])
        seg_entries = entries[seg_dest, np.arange(len(seg_n)) % K]
        count = seg_entries * np.where(sliced, seg_n * tokens, seg_runs)
        desc_end = np.cumsum(count)
        n_descs = int(desc_end[-1]) if len(desc_end) else 0
        if len(self.out) < n_descs:
            self.out = np.empty((n_descs, 3), _U64)
        out = self.out[:n_descs]
        s0, d0, ln = src[starts].astype(_U64), dst[starts].astype(_U64), lens.astype(_U64)

        def one(s: int) -> None:
            if not count[s]:
                return
            src_t, dst_t = self._tables(int(seg_dest[s]), s % K)
            blk = out[desc_end[s] - count[s] : desc_end[s]]
            if sliced[s]:
                h, per = self.slices[int(seg_dest[s])][s % K]
                lo = seg_off[s]
                sp, dp = src[lo : lo + seg_n[s]].astype(_U64), dst[lo : lo + seg_n[s]].astype(_U64)
                tok = np.arange(per, dtype=_U64)
                blk = blk.reshape(len(src_t), seg_n[s], per, 3)
                blk[..., 0] = (src_t[:, 0, None, None] + sp[None, :, None] * src_t[:, 1, None, None]
                               + tok * _U64(h.src_token_bytes) + _U64(h.src_head * h.bytes_per_head))
                blk[..., 1] = (dst_t[:, 0, None, None] + dp[None, :, None] * dst_t[:, 1, None, None]
                               + tok * _U64(h.dst_token_bytes) + _U64(h.dst_head * h.bytes_per_head))
                blk[..., 2] = _U64(h.nbytes)
                return
            r = slice(run_off[s], run_off[s] + seg_runs[s])
            blk = blk.reshape(len(src_t), seg_runs[s], 3)
            item = self._uniform_item(int(seg_dest[s]), s % K)
            if item is not None:  # one item length for all entries: the run terms are computed once
                np.add(src_t[:, 0, None], (s0[r] * item)[None], out=blk[..., 0])
                np.add(dst_t[:, 0, None], (d0[r] * item)[None], out=blk[..., 1])
                blk[..., 2] = (ln[r] * item)[None]
                return
            per_item = self._per_item(int(seg_dest[s]), s % K)
            np.add(src_t[:, 0, None], s0[None, r] * src_t[:, 1, None], out=blk[..., 0])
            np.add(dst_t[:, 0, None], d0[None, r] * dst_t[:, 1, None], out=blk[..., 1])
            np.multiply(ln[None, r], src_t[:, 1, None] if per_item is None else per_item[:, None], out=blk[..., 2])

        busy = np.flatnonzero(count)
        if self.pool is not None and len(busy) > 1:
            list(self.pool.map(one, busy.tolist()))
        else:
            for s in busy.tolist():
                one(s)
        per_transfer = desc_end.reshape(-1, K)[:, -1] if len(desc_end) else np.zeros(0, np.int64)
        return out, np.concatenate([[0], per_transfer]).astype(np.int64)


def prepared_ids(src: SideMemory, dsts: Sequence[SideMemory], columns: BatchColumns) -> tuple[np.ndarray, np.ndarray]:
    """``prepared-ids``: per request, ``entry * num_slots + id`` as int32 (no run merging), all sections."""
    lists, last, sent = host_lists(src, columns)
    K = lists.K
    slots = [prepared_slots(src, d) for d in dsts]
    dest = columns.column("dest")
    src_parts, dst_parts = [], []
    for t in range(columns.num_transfers):
        for k in range(K):
            s = t * K + k
            role = -1 if k == 0 else -2 if k == K - 1 else k - 1
            if (k == 0 and not sent[t]) or (k > 0 and not last[t]) or role not in slots[dest[t]]:
                continue
            entries, s_slots, d_slots = slots[dest[t]][role]
            lo, n = lists.seg_off[s], lists.seg_n[s]
            e = np.arange(entries, dtype=np.int64)[:, None]
            src_parts.append((e * s_slots + lists.src[lo : lo + n]).astype(np.int32).reshape(-1))
            dst_parts.append((e * d_slots + lists.dst[lo : lo + n]).astype(np.int32).reshape(-1))
    join = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int32)  # noqa: E731
    return join(src_parts), join(dst_parts)
