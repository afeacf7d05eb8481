"""vLLM's KV cache tensors as a kvplan side.

vLLM 0.33 hands the connector one view per attention layer (``register_kv_caches``), logically
``[blocks, heads, block_size, content]`` (K and V packed in the content), laid out in memory by the
configured ``KVCacheLayout``. kvplan moves whole blocks, so what it needs of a view is where block ``b``
lies and how long it is:

* **per layer** (layouts with the layer outermost, such as ``LBHNC`` and ``LBNHC``): each layer's
  blocks follow each other; a layer is one kvplan entry whose item is one of its blocks;
* **across layers** (``BLHNC``, ``BLNHC``: a block holds every layer's part): the layers' views
  tile one block stride; the whole is one entry whose item is the block of every layer, so a
  request's run of blocks is one descriptor for all layers.

A model's sliding-window KV cache groups (:mod:`.groups`) get views of their own over their layers
(:meth:`BlockView.of_groups`), each a SWA component of the side with its own block size; vLLM overlays the
groups' memory. A group whose pages vLLM padded to the largest (its blocks further apart than their bytes), or
whose layers hold other heads than the full group's, moves its blocks whole, so its peer must hold them alike
(its word names them: a peer of another TP or block size does not pair). A
Mamba group's layers are byte views ``[blocks, 1, states, state bytes]`` whose blocks lie one (padded)
page apart, and the group is a Mamba component of the side: each layer is an entry per tensor over its
blocks (the conv state, the temporal state), each naming its span and how it is sharded across TP ranks
(:mod:`.mamba_shards`), or, for a kind whose sharding kvplan does not know, one entry whose item is the
block, padding included.

A view whose blocks are not contiguous (the heads outermost, ``LHBNC``) is refused. The side is an
MLA-like layout (one entry per layer, no K/V split): kvplan copies a block as it is, so both sides
must lay blocks out alike; :attr:`BlockView.word` names what must match, and the endpoints refuse to
pair where it differs. Where each layer's block holds heads and tokens (``LBNHC``, ``LBHNC``), the KV
moves by head and the sides may differ in TP size; where its tokens also follow one another (``LBNHC``), a
block is a page of tokens and the sides may differ in block size: kvplan moves such KV in units of
the tokens the two block sizes share (docs/page_sizes.md). With the heads outside the tokens (``LBHNC``) the
pairing refuses other block sizes; where blocks move whole (the cross-layer layouts) the block size is part
of the word.

Example::

    kv_caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(64, 8, 16, 256, dtype=torch.bfloat16)
                 for i in range(2)}                             # [blocks, heads, block_size, 2 * head_size]
    view = BlockView.of(kv_caches, block_size=16)
    side = view.side(req_to_token=torch.zeros(9, 4096, dtype=torch.int32))
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from ...errors import LayoutError
from ...planner.contract.batch import Attention, Entry, KVLayout, SideMemory, StateComponent, TensorShard
from .groups import MAMBA_KIND, WINDOW_KIND, KVGroup

__all__ = ["BlockView", "layer_order"]


def layer_order(name: str) -> tuple:
    """Sort key of a vLLM layer name: its numbers as numbers (``layers.2`` before ``layers.10``)."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def _block_bytes(view: Any) -> int | None:
    """The bytes of one block of ``view`` (dimension 0 indexes blocks) when they are contiguous, else None."""
    dims = sorted(((view.stride(d), view.shape[d]) for d in range(1, view.dim()) if view.shape[d] > 1))
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    return expected * view.element_size()


def _tokens_dim(view: Any, block_size: int) -> int | None:
    """The dimension of ``view`` that counts a block's tokens (logically ``[blocks, heads, block_size,
    content]``: the third), or ``None`` where the shape does not say."""
    return 2 if view.dim() == 4 and int(view.shape[2]) == block_size else None


@dataclass(frozen=True)
class BlockView:
    """Where vLLM's blocks lie: ``entries`` (one per layer, or one across layers), the block count and
    what both sides must share (``word``: the endpoints pair only where it is equal)."""

    entries: tuple[Entry, ...]
    num_blocks: int
    block_size: int
    layers: tuple[str, ...]
    cross_layer: bool
    word: str
    heads: int = 0  # this rank's KV heads, where a layer's block holds them by head (else 0: moved whole)
    heads_outside: bool = False  # a block holds each head's tokens in a row (LBHNC), not each token's heads
    windows: tuple[tuple[int, "BlockView"], ...] = ()  # the sliding-window groups: (window in tokens, their view)
    mambas: tuple[tuple[Entry, ...], ...] = ()  # the Mamba groups: an entry per layer (and tensor), an item per block
    mamba_shards: tuple[tuple[TensorShard, ...], ...] = ()  # each Mamba group's entries' shards (or none)

    @classmethod
    def of_groups(cls, kv_caches: Mapping[str, Any], groups: Sequence[KVGroup], block_size: int) -> "BlockView":
        """The view of a model's KV cache groups (:func:`~.groups.transfer_groups`): the full-attention group's
        blocks as the KV, each sliding-window group's as a view of its own (its layers' tensors may be the
        full group's: vLLM overlays groups, a block belonging to one group at a time). No groups: every
        registered layer is one full-attention group."""
        if not groups:
            return cls.of(kv_caches, block_size)
        missing = sorted(n for g in groups for n in g.layers if n not in kv_caches)
        if missing:
            raise LayoutError(f"vLLM registered no KV cache for layers {missing[:4]} of its KV cache groups")
        mambas, shards = [], []
        for g in groups:
            if g.mamba:
                entries, tensors = _state_entries(kv_caches, g.layers), g.shards
                if tensors and max(t.offset + t.nbytes for t in tensors) > entries[0].item_len:
                    raise LayoutError(f"vLLM's Mamba state of {g.layers[0]} ({sum(t.nbytes for t in tensors)} bytes) "
                                      f"does not fit its blocks of {entries[0].item_len}")
                # (with its tensors' shards known, each layer is an entry per tensor over its page)
                mambas.append(tuple(e for e in entries for _ in tensors) or entries)
                shards.append(tensors * len(entries))
        views = [(g.window, cls.of({n: kv_caches[n] for n in g.layers}, g.block_size or block_size))
                 for g in groups if not g.mamba]
        kv = next(view for window, view in views if not window)
        windows = []
        for window, view in views:
            if not window:
                continue
            if view.heads and (view.heads != kv.heads or view.heads_outside != kv.heads_outside):
                # (a group of other heads than the KV's: its blocks move whole, so its word names its heads and a
                # peer of another TP size does not pair)
                view = cls.of({n: kv_caches[n] for n in view.layers}, view.block_size, whole=True)
            if view.cross_layer != kv.cross_layer:
                raise LayoutError(f"vLLM's sliding-window group of {view.layers[0]} is laid out unlike the "
                                  f"full-attention group ({view.word} against {kv.word})")
            windows.append((window, view))
        windows = tuple(windows)
        word = kv.word + "".join(f"/swa{window}:{len(view.entries)}x{view.word}" for window, view in windows)
        # (sharded state pairs by its shards, checked by the pairing; else by its blocks' bytes)
        word += "".join(f"/mamba:{len(entries)}x" + ("sharded" if tensors else str(entries[0].item_len))
                        for entries, tensors in zip(mambas, shards))
        return replace(kv, windows=windows, word=word, mambas=tuple(mambas), mamba_shards=tuple(shards))

    @classmethod
    def of(cls, kv_caches: Mapping[str, Any], block_size: int, whole: bool = False) -> "BlockView":
        """The block view of vLLM's per-layer KV tensors (refused, naming the layer, where a block is not
        one contiguous span or the layers disagree). A layer's blocks may lie further apart than their bytes
        (vLLM pads a smaller page to the largest): each block then moves whole, padding included, and its
        word names its shape, block size and stride. ``whole``: blocks move whole, never by head."""
        if not kv_caches:
            raise LayoutError("vLLM registered no KV cache tensors")
        names = sorted(kv_caches, key=layer_order)
        views, seen = [], set()
        for name in names:  # a layer that shares another's cache (vLLM's cross-layer sharing) moves with it
            view = kv_caches[name]
            key = (view.data_ptr(), tuple(view.shape), tuple(view.stride()))
            if key not in seen:
                seen.add(key)
                views.append((name, view))
        first_name, first = views[0]
        for name, view in views:
            if view.dim() < 2 or view.shape[0] != first.shape[0] or view.dtype != first.dtype \
                    or view.device != first.device:
                raise LayoutError(f"vLLM's KV cache of layer {name}: {view.dtype} {tuple(view.shape)} on {view.device}, "
                                  f"where {first_name} is {first.dtype} {tuple(first.shape)} on {first.device}: "
                                  "kvplan's connector moves one KV cache group of alike layers")
            if _block_bytes(view) is None:
                raise LayoutError(f"vLLM's KV cache of layer {name} (shape {tuple(view.shape)}, strides "
                                  f"{tuple(view.stride())}) does not hold a block in one span: a layout with the "
                                  "heads outside the blocks (LHBNC) is not covered")
        blocks, unit = int(first.shape[0]), first.element_size()
        block_bytes = [_block_bytes(v) for _, v in views]
        strides = {v.stride(0) * unit for _, v in views}
        order = tuple(sorted(range(1, first.dim()), key=lambda d: -first.stride(d)))
        # what both sides must share: the dtype, each block's shape but its token count, the byte order
        shape = [int(x) for x in first.shape[1:]]
        tokens_dim = _tokens_dim(first, block_size)
        per_layer = strides == set(block_bytes[:1]) and len(set(block_bytes)) == 1  # each layer's blocks in a row
        # each layer's blocks in a row, each padded to a larger page (the layers' spans apart)
        spans = sorted(v.data_ptr() for _, v in views)
        padded = len(strides) == 1 and len(set(block_bytes)) == 1 and min(strides) > block_bytes[0] and all(
            b - a >= min(strides) * blocks for a, b in zip(spans, spans[1:]))
        # a layer's block of heads and tokens with each token's content innermost is KV by head: the tokens
        # outside the heads (NHD) or the heads outside the tokens (HND). Sides of other TP sizes pair (each rank's
        # heads, docs/tp_state.md), and, with the tokens outside, of other block sizes (kvplan moves units of
        # their common tokens, docs/page_sizes.md); the pairing checks both, so the word names neither.
        # (Among the dimensions of more than one element: a rank of one head gives its heads any stride, and
        # its blocks are the same bytes either way.)
        wide = [d for d in order if first.shape[d] > 1]
        by_head = per_layer and not whole and tokens_dim is not None and bool(wide) and wide[-1] == 3 \
            and tokens_dim in wide
        heads_outside = by_head and wide[0] == 1
        if by_head:
            shape[0] = shape[tokens_dim - 1] = -1
        base = f"vllm-kv/{str(first.dtype).removeprefix('torch.')}/{tuple(shape)}/" + \
            ("by-head" if by_head else f"order{order}")
        if per_layer:
            entries = tuple(Entry(v.data_ptr(), block_bytes[0], blocks) for _, v in views)
            word = f"{base}/per-layer" + ("" if by_head else f"/bs{block_size}")
            return cls(entries, blocks, block_size, tuple(n for n, _ in views), False, word,
                       int(first.shape[1]) if by_head else 0, heads_outside)
        if padded:
            stride = min(strides)
            return cls(tuple(Entry(v.data_ptr(), stride, blocks) for _, v in views), blocks, block_size,
                       tuple(n for n, _ in views), False, f"{base}/per-layer/bs{block_size}/padded{stride}")
        stride = strides.pop() if len(strides) == 1 else None
        starts = sorted((v.data_ptr(), b) for (_, v), b in zip(views, block_bytes))
        tiled = stride is not None and all(a + b == c for (a, b), (c, _) in zip(starts, starts[1:])) \
            and starts[-1][0] + starts[-1][1] - starts[0][0] == stride
        if not tiled:
            raise LayoutError(f"vLLM's KV caches of {len(views)} layers have block strides {sorted(strides)} bytes and "
                              f"blocks of {sorted(set(block_bytes))}: neither one layer's blocks after another nor "
                              "every layer's part of a block side by side")
        return cls((Entry(starts[0][0], stride, blocks),), blocks, block_size, tuple(n for n, _ in views), True,
                   f"{base}/cross-layer{len(views)}/bs{block_size}")

    @property
    def slices_heads(self) -> bool:
        """Whether a side of another TP size pairs with this one (each rank's heads moved)."""
        return self.heads > 0

    def side(self, req_to_token: Any = None, tp_size: int = 1, tp_rank: int = 0,
             window_maps: Sequence[Any] = (), state_maps: Sequence[Any] = ()) -> SideMemory:
        """This view as a kvplan side over ``req_to_token`` (its planning table: token slots, block
        ``b``'s tokens being ``b * block_size ...``), rank ``tp_rank`` of ``tp_size``: KV by head where a
        layer's block holds heads and tokens (``LBNHC``: packed heads token by token; ``LBHNC``: each head's
        tokens in a row), else blocks moved whole (one entry per layer either way). Each sliding-window group
        is a SWA component over its own blocks, reached through its map in ``window_maps`` (a full-group slot
        to its slot, :mod:`.windows`); its window is the tokens the next token attends to besides itself
        (vLLM keeps their blocks: ``sliding_window - 1``), from the decode's prefix on. Each Mamba group is
        a Mamba component over its layers' blocks, its block per planning row in its map in ``state_maps``."""
        if not self.slices_heads:
            kv = KVLayout(Attention.MLA, self.block_size, self.entries)
        else:
            kind = Attention.MHA_HEAD_MAJOR if self.heads_outside else Attention.MHA_PACKED
            kv = KVLayout(kind, self.block_size, self.entries, num_kv_heads=self.heads * tp_size, tp_size=tp_size,
                          tp_rank=tp_rank)
        if len(window_maps) != len(self.windows):
            raise LayoutError(f"{len(self.windows)} sliding-window groups, {len(window_maps)} slot maps")
        if len(state_maps) != len(self.mambas):
            raise LayoutError(f"{len(self.mambas)} Mamba groups, {len(state_maps)} slot maps")
        state = tuple(StateComponent(WINDOW_KIND, view.entries, window=window - 1, slot_map=slot_map,
                                     page_size=view.block_size if view.block_size != self.block_size else None,
                                     name=f"swa{g}", from_prefix=True)
                      for g, ((window, view), slot_map) in enumerate(zip(self.windows, window_maps)))
        state += tuple(StateComponent(MAMBA_KIND, entries, slot_map=slot_map, name=f"mamba{g}", shards=shards)
                       for g, (entries, shards, slot_map) in enumerate(zip(self.mambas, self.mamba_shards, state_maps)))
        return SideMemory(kv, state, req_to_token=req_to_token)


def _state_entries(kv_caches: Mapping[str, Any], layers: Sequence[str]) -> tuple[Entry, ...]:
    """A Mamba group's layers as entries, in layer order: one per distinct view, an item per block (its
    whole page: the block stride). Refused, naming the layer, where a block's bytes are not one span."""
    entries, seen = [], set()
    for name in sorted(layers, key=layer_order):
        if name not in kv_caches:
            raise LayoutError(f"vLLM registered no KV cache for Mamba layer {name}")
        view = kv_caches[name]
        if not hasattr(view, "data_ptr"):
            raise LayoutError(f"vLLM's KV cache of Mamba layer {name} is a {type(view).__name__}, not one tensor of "
                              "blocks (vLLM 0.33's byte view)")
        stride, inner = view.stride(0) * view.element_size(), _block_bytes(view)
        if inner is None or inner > stride:
            raise LayoutError(f"vLLM's KV cache of Mamba layer {name} (shape {tuple(view.shape)}, strides "
                              f"{tuple(view.stride())}) does not hold a block's state in one span")
        if view.data_ptr() not in seen:
            seen.add(view.data_ptr())
            entries.append(Entry(view.data_ptr(), stride, int(view.shape[0])))
    return tuple(entries)
