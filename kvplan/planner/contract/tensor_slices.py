"""TP-sliced state items: which bytes of a source rank's item land where in a destination rank's.

Mamba state is sharded along one dimension of each tensor (docs/tp_state.md §4). Between sides of
different attention-TP sizes, a source rank's item and a destination rank's item overlap in one or
more byte blocks: one per outer row and per shard group (GDN's ``conv_state`` is ``query | key |
value``, each sub-block sharded on its own). A component's entries become *sliced entries*, one per
block, each an ``(src_base + src_offset, dst_base + dst_offset)`` pair over the sides' own item
strides that moves ``nbytes`` per item, so that every planner (reference, device, host baselines)
expands them as direct descriptors with one descriptor per sliced entry and slot.

Example: TP 4 -> 8, a conv entry of 32 channels of 2 bytes in groups ``(8, 8, 16)`` (query, key,
value): source rank 1 holds 8 channels (16 bytes), destination rank 3 holds 4 (8 bytes), the second
half of the source's part of each group::

    >>> tensor_blocks(16, 8, TensorShard(8, groups=(8, 8, 16)), TensorShard(4, groups=(8, 8, 16)), 4, 8, 1, 3)
    [(2, 0, 2), (6, 2, 2), (12, 4, 4)]
"""

from __future__ import annotations

import numpy as np

from ...errors import LayoutError
from .batch import KVLayout, StateComponent, TensorShard

__all__ = ["partner_rank", "sliced_entries", "tensor_blocks"]


def partner_rank(rank: int, tp: int, other_tp: int) -> int:
    """The rank of TP size ``other_tp`` whose part of a sharded tensor holds, or lies inside,
    ``rank``'s part at TP size ``tp`` (the larger TP size's ranks share the smaller's by blocks).

    >>> partner_rank(3, 8, 4), partner_rank(5, 8, 4), partner_rank(1, 4, 8)
    (1, 2, 2)
    """
    return rank // (tp // other_tp) if tp >= other_tp else rank * (other_tp // tp)


def tensor_blocks(src_item: int, dst_item: int, src: TensorShard, dst: TensorShard, ts: int, td: int,
                  src_rank: int, dst_rank: int) -> list[tuple[int, int, int]]:
    """The ``(src_offset, dst_offset, nbytes)`` blocks a source rank's item sends into a destination
    rank's item (docs/tp_state.md §4), in item order: outer row by row, group by group.

    Raises :class:`LayoutError` when the two shards do not describe one tensor, when the TP sizes do
    not divide, or when the source rank does not hold the destination rank's part. A shard that names a
    span (``offset``, ``nbytes``) is that span of its item; blocks that follow each other on both sides
    are merged into one.

    >>> tensor_blocks(8, 4, TensorShard(4), TensorShard(2), 2, 4, 1, 3)   # 2 bytes per position
    [(4, 0, 4)]
    >>> tensor_blocks(4, 8, TensorShard(2), TensorShard(4), 4, 2, 3, 1)
    [(0, 4, 4)]
    """
    for side, shard, item in (("source", src, src_item), ("destination", dst, dst_item)):
        if shard.offset + shard.nbytes > item:
            raise LayoutError(f"the {side}'s tensor of {shard.nbytes} bytes at {shard.offset} overruns its item of "
                              f"{item} bytes")
    blocks = _blocks(src.nbytes or src_item, dst.nbytes or dst_item, src, dst, ts, td, src_rank, dst_rank)
    merged: list[tuple[int, int, int]] = []
    for so, do, n in blocks:  # (in item order; blocks that follow each other on both sides are one)
        if merged and merged[-1][0] + merged[-1][2] == so + src.offset and merged[-1][1] + merged[-1][2] == do + dst.offset:
            merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + n)
        else:
            merged.append((so + src.offset, do + dst.offset, n))
    return merged


def _blocks(src_item: int, dst_item: int, src: TensorShard, dst: TensorShard, ts: int, td: int,
            src_rank: int, dst_rank: int) -> list[tuple[int, int, int]]:
    """:func:`tensor_blocks` within the tensors, before their offsets and merging."""
    big, small = max(ts, td), min(ts, td)
    if big % small:
        raise LayoutError(f"one attention-TP size must divide the other to slice state ({ts} and {td})")
    if src.replicated != dst.replicated:
        raise LayoutError(f"one side shards the tensor (dims {src.dim} and {dst.dim}), the other replicates it")
    if src.replicated:
        if src_item != dst_item:
            raise LayoutError(f"a replicated item must be equal on both sides (source {src_item}, destination "
                              f"{dst_item})")
        # one source rank per destination writes it: every source when scattering, the first of
        # each aggregated group otherwise
        return [(0, 0, src_item)] if ts <= td or src_rank % (ts // td) == 0 else []
    full = src.dim * ts
    if dst.dim * td != full:
        raise LayoutError(f"the sharded dimension differs: {src.dim} x TP {ts} on the source, {dst.dim} x TP {td} "
                          "on the destination")
    if src.outer != dst.outer or src.groups != dst.groups:
        raise LayoutError(f"the sides shard the tensor differently (outer {src.outer}/{dst.outer}, groups "
                          f"{src.groups}/{dst.groups})")
    if src_item % (src.outer * src.dim) or dst_item % (dst.outer * dst.dim):
        raise LayoutError(f"items of {src_item}/{dst_item} bytes are not {src.outer} rows of {src.dim}/{dst.dim} "
                          "positions")
    unit = src_item // (src.outer * src.dim)
    if dst_item // (dst.outer * dst.dim) != unit:
        raise LayoutError(f"bytes per position differ: source {unit}, destination {dst_item // (dst.outer * dst.dim)}")
    groups = src.groups or (full,)
    if sum(groups) != full or any(g % big for g in groups):
        raise LayoutError(f"shard groups {groups} must sum to the dimension {full} and each split into {big} ranks")
    if ts < td and partner_rank(dst_rank, td, ts) != src_rank:
        raise LayoutError(f"destination rank {dst_rank} of TP {td} takes its part from source rank "
                          f"{partner_rank(dst_rank, td, ts)} of TP {ts}, not {src_rank}")
    if ts > td and partner_rank(src_rank, ts, td) != dst_rank:
        raise LayoutError(f"source rank {src_rank} of TP {ts} writes into destination rank "
                          f"{partner_rank(src_rank, ts, td)} of TP {td}, not {dst_rank}")
    logical = []  # (src position, dst position, positions) within one outer row
    s_off = d_off = 0
    for g in groups:
        s_sub, d_sub = g // ts, g // td
        if ts < td:  # the destination's part of this group, inside the source's
            logical.append((s_off + (dst_rank % (td // ts)) * d_sub, d_off, d_sub))
        else:  # the source's part of this group, at its place in the destination's
            logical.append((s_off, d_off + (src_rank % (ts // td)) * s_sub, s_sub))
        s_off, d_off = s_off + s_sub, d_off + d_sub
    return [((o * src.dim + s) * unit, (o * dst.dim + d) * unit, n * unit)
            for o in range(src.outer) for s, d, n in logical]


def sliced_entries(what: str, sc: StateComponent, dc: StateComponent, sk: KVLayout, dk: KVLayout
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A sharded component's sliced entries between different TP sizes: ``(src_table, dst_table,
    nbytes, entry_of)``, the tables ``[n, 2]`` uint64 ``(base + offset, item_len)``, ``nbytes`` ``[n]``
    the bytes each moves per item and ``entry_of`` ``[n]`` the entry each slices, entry by entry in
    entry order (LayoutError naming ``what``)."""
    if len(sc.entries) != len(dc.entries):
        raise LayoutError(f"{what}: source has {len(sc.entries)} entries, destination {len(dc.entries)}")
    if not sc.shards or not dc.shards:
        side = "source" if not sc.shards else "destination"
        raise LayoutError(f"{what}: moved between TP sizes {sk.tp_size} and {dk.tp_size}, its entries must declare "
                          f"how they are sharded (StateComponent.shards; the {side} has none; docs/tp_state.md §4)")
    rows = []
    for e, (s, d, s_shard, d_shard) in enumerate(zip(sc.entries, dc.entries, sc.shards, dc.shards)):
        try:
            blocks = tensor_blocks(s.item_len, d.item_len, s_shard, d_shard, sk.tp_size, dk.tp_size,
                                   sk.tp_rank, dk.tp_rank)
        except LayoutError as err:
            raise LayoutError(f"{what} entry {e}: {err}") from None
        rows += [(s.base_ptr + so, s.item_len, d.base_ptr + do, d.item_len, n, e) for so, do, n in blocks]
    table = np.array(rows, dtype=np.uint64).reshape(-1, 6)
    return table[:, 0:2].copy(), table[:, 2:4].copy(), table[:, 4].copy(), table[:, 5].astype(np.int64)
