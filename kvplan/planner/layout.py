"""The host side of planning a batch: from transfers to segments, destination lists and entry tables.

Everything here needs only what the scheduler already knows on the host (lengths, rows, the
destination lists it received); token slots are the kernels' business. :func:`lay_out` takes a
whole-batch NumPy path for valid ``strict`` batches; a batch that fails any of its checks, or a
``truncate`` batch, goes through :func:`_lay_out_each`, one transfer at a time with the
reference's own checks, which raises the precise error (naming the request) or, under
``truncate``, truncates with a warning exactly as the reference does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError, LengthMismatchError
from ..kernels import descriptors as kd
from ..kernels import index_lists as ki
from .lists import Segment, SegmentTable, component_segment, pages_segment
from .model import Batch, Policy, StateKind
from .pairing import Mode, SidePairing, pair_sides
from .prepared import AUX, KV
from .reference import check_aux, check_bounds, check_row, paired_length, resolve_chunk

__all__ = ["Layout", "lay_out"]

NO_LIMIT = 1 << 62


@dataclass
class Layout:
    """A batch laid out for the kernels; segments are in transfer order (KV, components, aux)."""

    segments: SegmentTable
    dst: np.ndarray  # the destination lists of every segment, back to back (int64)
    entry_off: np.ndarray  # per segment: first row of its entry pairs in ``entry_table``
    entries: np.ndarray  # per segment: number of entry pairs
    head_slices: np.ndarray  # per segment: [S, HS_FIELDS], zeros unless head-sliced
    seg_first: np.ndarray  # [T + 1]: transfer t owns segments seg_first[t] .. seg_first[t+1]
    requests: list[Any]
    dest: np.ndarray
    start: np.ndarray
    end: np.ndarray
    last: np.ndarray
    sent: np.ndarray
    dst_pages: list[np.ndarray]  # per transfer: its slice of the destination's KV pages
    modes: list[Mode]  # per destination
    entry_table: np.ndarray  # [NE, 4] uint64: (src_base, dst_base, src_item, dst_item)
    component_names: list[str]


class _Entries:
    """The entry pairs of every destination and role, stacked into one table."""

    def __init__(self, pairings: list[SidePairing]):
        blocks, self.index, count = [], {}, 0
        for d, p in enumerate(pairings):
            tables = [(KV, p.kv_src, p.kv_dst), (AUX, p.aux_src, p.aux_dst)]
            tables += [(c, s, t) for c, (s, t) in enumerate(zip(p.state_src, p.state_dst))]
            for role, src_t, dst_t in tables:
                block = np.zeros((len(src_t), 4), dtype=np.uint64)
                block[:, 0], block[:, 1], block[:, 2], block[:, 3] = src_t[:, 0], dst_t[:, 0], src_t[:, 1], dst_t[:, 1]
                blocks.append(block)
                self.index[(d, role)] = (count, len(block))
                count += len(block)
        self.table = np.concatenate(blocks) if blocks else np.zeros((0, 4), dtype=np.uint64)


def _head_slice(pairing: SidePairing, page_size: int) -> tuple[int, ...]:
    h = pairing.heads
    return (page_size, h.src_token_bytes, h.dst_token_bytes, h.src_head * h.bytes_per_head,
            h.dst_head * h.bytes_per_head, h.nbytes)


def lay_out(batch: Batch, table_shape: tuple[int, int]) -> Layout:
    """Lay out ``batch``; raises the first error visible from lengths alone, naming its request."""
    pairings = [pair_sides(batch.src, d) for d in batch.dsts]
    for comp in batch.src.state:
        comp.require_map()
    entries = _Entries(pairings)
    if batch.policy is Policy.STRICT and batch.transfers:
        layout = _lay_out_batch(batch, table_shape, pairings, entries)
        if layout is not None:
            return layout
    return _lay_out_each(batch, table_shape, pairings, entries)


# ------------------------------------------------------------------------------------------
# one transfer at a time: the reference's checks and messages


def _lay_out_each(batch: Batch, table_shape: tuple[int, int], pairings: list[SidePairing], entries: _Entries) -> Layout:
    src, policy, ps = batch.src, batch.policy, batch.src.kv.page_size
    segments: list[Segment] = []
    expansion: list[tuple[int, int, tuple[int, ...]]] = []
    dst_lists: list[np.ndarray] = []
    seg_first, info = [0], []
    zero_slice = (0,) * kd.HS_FIELDS

    def add(seg: Segment, dest: int, dst: np.ndarray, head_slice: tuple[int, ...] = zero_slice) -> None:
        segments.append(seg)
        expansion.append((*entries.index[(dest, seg.role)], head_slice))
        dst_lists.append(np.asarray(dst, dtype=np.int64))

    for index, t in enumerate(batch.transfers):
        request = t.request
        if not 0 <= t.dest < len(pairings):
            raise InputError(request, f"destination {t.dest} is not one of the batch's {len(pairings)} destinations")
        pairing, dst_side = pairings[t.dest], batch.dsts[t.dest]
        chunk = resolve_chunk(t, ps, table_shape, dst_side.kv.num_pages, policy)
        info.append((request, t.dest, t.start, chunk.end, chunk.last, chunk.sent, chunk.dst_pages))
        seg = pages_segment(index, t.src_row, t.start, chunk.end, ps, src.kv.num_pages, batch.validate,
                            chunk.pages if chunk.sent else 0)
        if chunk.sent or seg.check is not None:  # a chunk that is not sent still gets its slots checked
            sliced = chunk.sent and pairing.mode is Mode.HEAD_SLICED
            add(seg, t.dest, chunk.dst_pages if chunk.sent else chunk.dst_pages[:0],
                _head_slice(pairing, ps) if sliced else zero_slice)
        if chunk.last:
            seq = min(t.fill_len, t.prompt_len)
            if len(t.dst_state) != len(src.state):
                raise LengthMismatchError(request, f"{len(src.state)} state components on the source, "
                                          f"{len(t.dst_state)} destination lists")
            for c, (comp, dst_list) in enumerate(zip(src.state, t.dst_state)):
                what = f"state component {comp.name}"
                if comp.kind in (StateKind.SWA, StateKind.DSA):
                    check_row(request, table_shape, t.src_row, seq)
                seg = component_segment(index, c, comp, ps, t.src_row, seq, batch.validate)
                always_strict = comp.kind in (StateKind.SWA_RING, StateKind.MAMBA)
                seg.n = paired_length(request, what, seg.n, len(dst_list), policy, always_strict)
                dst_list = dst_list[: seg.n]
                check_bounds(request, f"destination {dst_side.state[c].name}", dst_list, 0, dst_side.state[c].num_items)
                add(seg, t.dest, dst_list)
            if check_aux(t, src, dst_side):
                add(Segment(index, AUX, ki.CONST, 0, t.aux_src, 1, 1, 0, NO_LIMIT), t.dest,
                    np.array([t.aux_dst], dtype=np.int64))
        seg_first.append(len(segments))
    cols = list(zip(*info)) if info else [[]] * 7
    return Layout(
        segments=SegmentTable.from_segments(segments),
        dst=np.concatenate(dst_lists) if dst_lists else np.zeros(0, dtype=np.int64),
        entry_off=np.array([x[0] for x in expansion], dtype=np.int64),
        entries=np.array([x[1] for x in expansion], dtype=np.int64),
        head_slices=np.array([x[2] for x in expansion], dtype=np.int64).reshape(-1, kd.HS_FIELDS),
        seg_first=np.array(seg_first, dtype=np.int64),
        requests=list(cols[0]), dest=np.array(cols[1], dtype=np.int64), start=np.array(cols[2], dtype=np.int64),
        end=np.array(cols[3], dtype=np.int64), last=np.array(cols[4], dtype=bool), sent=np.array(cols[5], dtype=bool),
        dst_pages=list(cols[6]), modes=[p.mode for p in pairings], entry_table=entries.table,
        component_names=[c.name for c in src.state])


# ------------------------------------------------------------------------------------------
# the whole batch at once (strict, valid batches); ``None`` sends the batch through _lay_out_each


def _within(values: list[np.ndarray], lowest: np.ndarray, limit: np.ndarray) -> bool:
    """Whether every list ``i`` lies in ``[lowest[i], limit[i])``."""
    if not values:
        return True
    sizes = np.array([len(v) for v in values], dtype=np.int64)
    flat = np.concatenate(values)
    return bool(((flat >= np.repeat(lowest, sizes)) & (flat < np.repeat(limit, sizes))).all())


def _lay_out_batch(batch: Batch, table_shape: tuple[int, int], pairings: list[SidePairing],
                   entries: _Entries) -> Layout | None:
    src, transfers, ps = batch.src, batch.transfers, batch.src.kv.page_size
    rows, max_ctx = table_shape
    C, D, T = len(src.state), len(pairings), len(transfers)
    x = np.array([(t.src_row, t.start, t.fill_len, t.prompt_len, t.last, t.prefix_len, t.aux_src, t.aux_dst, t.dest,
                   len(t.dst_pages), len(t.dst_state)) for t in transfers], dtype=np.int64)
    row, start, fill, length, flag, prefix, aux_src, aux_dst, dest, total, n_state = x.T
    if ((dest < 0) | (dest >= D)).any():
        return None
    seq = np.minimum(fill, length)
    end = np.where(flag == 1, seq, np.maximum(start, seq // ps * ps))
    n = -(-(end - start) // ps)
    cursor = (start - prefix) // ps
    last = cursor + n >= total
    bad = ((start % ps != 0) | (prefix % ps != 0) | (start < prefix) | (end < start) | (row <= 0) | (row >= rows)
           | (end > max_ctx) | (total - cursor < n) | (last != (flag == 1)) | (last & (n_state != C)))
    if bad.any():
        return None
    sent = last | (n > 0)
    dst_pages = [t.dst_pages[c : c + k] for t, c, k in zip(transfers, cursor.tolist(), n.tolist())]
    dst_kv_pages = np.array([d.kv.num_pages for d in batch.dsts], dtype=np.int64)
    if not _within(dst_pages, np.ones(T, np.int64), dst_kv_pages[dest]):
        return None
    lasts = np.flatnonzero(last)
    has_aux = bool(src.aux)
    if has_aux:
        src_aux = min(e.num_items for e in src.aux)
        dst_aux = np.array([min((e.num_items for e in d.aux), default=0) for d in batch.dsts], dtype=np.int64)
        a_s, a_d = aux_src[lasts], aux_dst[lasts]
        if ((a_s < 0) | (a_s >= src_aux) | (a_d < 0) | (a_d >= dst_aux[dest[lasts]])).any():
            return None

    # one column per slot: KV, each component, aux; rows are transfers
    K = 2 + C
    present = np.zeros((T, K), dtype=bool)
    cols = {f: np.zeros((T, K), dtype=np.int64) for f in ("kind", "row", "a", "step", "n", "lo", "hi", "ring")}
    map_key = np.full((T, K), -1, dtype=np.int64)
    check = np.zeros((T, K, 4), dtype=np.int64)
    check[..., 3] = 1
    dst_parts: list[list[np.ndarray | None]] = [[None] * K for _ in range(T)]
    validate = batch.validate

    tokens = end - start
    present[:, 0] = sent | (validate & (tokens > 0))
    for f, v in (("kind", ki.TOKEN_PAGES), ("row", row), ("a", start), ("step", ps), ("n", np.where(sent, n, 0)),
                 ("lo", 1), ("hi", src.kv.num_pages), ("ring", 1)):
        cols[f][:, 0] = v
    if validate:
        check[:, 0] = np.stack([row, start, tokens, np.full(T, ps)], axis=1)
    for t in range(T):
        dst_parts[t][0] = dst_pages[t] if sent[t] else dst_pages[t][:0]

    seq_l, row_l = seq[lasts], row[lasts]
    for c, comp in enumerate(src.state):
        k = 1 + c
        cps = comp.pages_of(ps)
        present[lasts, k] = True
        lists = [transfers[i].dst_state[c] for i in lasts.tolist()]
        dst_len = np.array([len(v) for v in lists], dtype=np.int64)
        kind, a, step, ring, count, lo = ki.TOKEN_PAGES, np.zeros_like(seq_l), cps, 1, None, 1
        chk = None
        if comp.kind is StateKind.MAMBA:
            kind, step, count, lo = ki.ROW_MAP, 1, np.ones_like(seq_l), 0
            map_key[lasts, k] = c
        elif comp.kind is StateKind.SWA_RING:
            a = np.maximum(0, seq_l - comp.window)
            kind, step, ring, count, lo = ki.RING, 1, comp.ring_size, seq_l - a, 0
        elif comp.kind is StateKind.DSA:
            count = -(-seq_l // cps)
            chk = np.stack([row_l, a, seq_l, np.full_like(seq_l, cps)], axis=1)
        else:
            a = np.maximum(0, seq_l - comp.window) // cps * cps
            kind, count = ki.MAPPED_PAGES, -(-(seq_l - a) // cps)
            map_key[lasts, k] = c
            chk = np.stack([row_l, a, seq_l - a, np.full_like(seq_l, cps)], axis=1)
        if (count != dst_len).any():
            return None
        dst_items = np.array([d.state[c].num_items for d in batch.dsts], dtype=np.int64)[dest[lasts]]
        if not _within(lists, np.zeros(len(lasts), np.int64), dst_items):
            return None
        for f, v in (("kind", kind), ("row", row_l), ("a", a), ("step", step), ("n", count), ("lo", lo),
                     ("hi", comp.num_items), ("ring", ring)):
            cols[f][lasts, k] = v
        if validate and chk is not None:
            check[lasts, k] = chk
        for i, v in zip(lasts.tolist(), lists):
            dst_parts[i][k] = v
    if has_aux:
        present[lasts, K - 1] = True
        for f, v in (("kind", ki.CONST), ("a", aux_src[lasts]), ("step", 1), ("n", 1), ("hi", NO_LIMIT), ("ring", 1)):
            cols[f][lasts, K - 1] = v
        aux_lists = aux_dst[lasts].reshape(-1, 1)
        for j, i in enumerate(lasts.tolist()):
            dst_parts[i][K - 1] = aux_lists[j]
    check[..., 2] *= present  # no check for absent slots
    check[:, 1 : 1 + C, 2] *= validate

    mask = present.reshape(-1)
    owner = np.repeat(np.arange(T, dtype=np.int64), K)[mask]
    role = np.tile(np.array([KV, *range(C), AUX], dtype=np.int64), T)[mask]
    table = SegmentTable(owner=owner, role=role, **{f: v.reshape(-1)[mask] for f, v in cols.items()},
                         map_key=map_key.reshape(-1)[mask], check=check.reshape(-1, 4)[mask])
    slot_of_role = {KV: 0, AUX: K - 1, **{c: 1 + c for c in range(C)}}
    off = np.zeros((D, K), dtype=np.int64)
    cnt = np.zeros((D, K), dtype=np.int64)
    for (d, r), (o, e) in entries.index.items():
        off[d, slot_of_role[r]], cnt[d, slot_of_role[r]] = o, e
    slot = np.tile(np.arange(K), T)[mask]
    seg_dest = dest[owner]
    head_slices = np.zeros((len(owner), kd.HS_FIELDS), dtype=np.int64)
    for d, p in enumerate(pairings):
        if p.mode is Mode.HEAD_SLICED:
            rows_hs = (seg_dest == d) & (role == KV) & sent[owner]
            head_slices[rows_hs] = _head_slice(p, ps)
    dst = [part for parts, keep in zip(dst_parts, present) for part, k in zip(parts, keep) if k]
    seg_first = np.zeros(T + 1, dtype=np.int64)
    np.cumsum(present.sum(axis=1), out=seg_first[1:])
    return Layout(
        segments=table, dst=np.concatenate(dst).astype(np.int64, copy=False) if dst else np.zeros(0, np.int64),
        entry_off=off[seg_dest, slot], entries=cnt[seg_dest, slot], head_slices=head_slices, seg_first=seg_first,
        requests=[t.request for t in transfers], dest=dest, start=start, end=end, last=last, sent=sent,
        dst_pages=dst_pages, modes=[p.mode for p in pairings], entry_table=entries.table,
        component_names=[c.name for c in src.state])
