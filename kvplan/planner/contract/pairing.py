"""How a source side pairs with a destination side: entries, mode, head slices (planning.md §1, §5).

Both the NumPy reference and the GPU planner take their pairing from here, so the two can only
differ in how they compute lists and descriptors, never in what they pair.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from math import gcd
from typing import Sequence

import numpy as np

from ...errors import LayoutError
from .batch import Attention, Entry, KVLayout, SideMemory
from .state_kinds import rules_of
from .tensor_slices import sliced_entries

__all__ = ["HeadSlice", "Mode", "SidePairing", "head_slice", "pair_sides", "paired_attention", "smallest_descriptor"]


class Mode(str, enum.Enum):
    DIRECT = "direct"
    HEAD_SLICED = "head_sliced"


@dataclass(frozen=True)
class HeadSlice:
    """Which heads a rank sends where, in head-sliced mode (planning.md §5)."""

    src_head: int
    heads_sent: int
    dst_head: int
    bytes_per_head: int  # per token (per page where ``per_page``)
    src_token_bytes: int  # src_item / ps (src_item where ``per_page``)
    dst_token_bytes: int  # dst_item / ps (dst_item where ``per_page``)
    per_page: bool = False  # the heads lie outside the tokens: one span of the slice per page

    def spans_per_page(self, tokens: int) -> int:
        """Descriptors per page (or unit) of ``tokens`` tokens: one per token, or one where the heads lie
        outside the tokens (``Attention.MHA_HEAD_MAJOR``)."""
        return 1 if self.per_page else tokens

    @property
    def nbytes(self) -> int:
        return self.heads_sent * self.bytes_per_head

    @property
    def whole_destination(self) -> bool:
        """Whether each destination token receives all of its bytes from this slice (scatter or equal
        TP: every head the destination holds, from head 0), so that the slice's bytes, token after
        token, are the destination's pages whole."""
        return self.dst_head == 0 and self.nbytes == self.dst_token_bytes


def head_slice(src: KVLayout, dst: KVLayout, src_item: int, dst_item: int, pages: tuple[int, int] | None = None,
               per_page: bool = False) -> HeadSlice:
    """The head slice a source rank sends to a destination rank (planning.md §5); ``pages``: the
    tokens per item on each side when they are not the KV page sizes (a state component's pages;
    docs/tp_state.md); ``per_page``: the items hold each head's tokens in a row
    (``Attention.MHA_HEAD_MAJOR``), so the slice is one span per item.

    >>> def lay(ts, rank): return KVLayout(Attention.MHA, 1, (), num_kv_heads=8, tp_size=ts, tp_rank=rank)
    >>> [head_slice(lay(4, r), lay(2, 0), 256, 512).dst_head for r in range(4)]
    [0, 2, 0, 2]
    """
    if not src.num_kv_heads or not dst.num_kv_heads:
        raise LayoutError("a side's number of KV heads is not known (0); head slicing needs the model's count")
    if src.num_kv_heads != dst.num_kv_heads:
        raise LayoutError(f"the sides disagree on the number of KV heads: {src.num_kv_heads} vs {dst.num_kv_heads}")
    heads, ts, td = src.num_kv_heads, src.tp_size, dst.tp_size
    ps_s, ps_d = pages or (src.page_size, dst.page_size)
    src_heads, dst_heads = max(1, heads // ts), max(1, heads // td)
    if src_item % ps_s or dst_item % ps_d:
        raise LayoutError(f"item lengths {src_item}/{dst_item} are not whole tokens of page sizes {ps_s}/{ps_d}")
    src_token, dst_token = src_item // ps_s, dst_item // ps_d
    if dst_token % dst_heads or src_token % src_heads:
        raise LayoutError(f"token bytes {src_token}/{dst_token} do not split into {src_heads}/{dst_heads} heads")
    bph = dst_token // dst_heads
    if src_token // src_heads != bph:
        raise LayoutError(f"bytes per head differ: source {src_token // src_heads}, destination {bph}")
    if per_page:  # a page holds each head's tokens in a row: the slice is one span of each page
        if src.page_size != dst.page_size:
            raise LayoutError(f"pages of {src.page_size} and {dst.page_size} tokens with the heads outside the tokens: "
                              "a page's tokens are not one span, so both sides' page sizes must be equal")
        return replace(head_slice(src, dst, src_item, dst_item, (1, 1)), per_page=True)
    if ts > td:
        unique = src.tp_rank // max(1, ts // heads)
        src_head, heads_sent, dst_head = 0, src_heads, (unique * src_heads) % dst_heads
    else:
        unique = dst.tp_rank // max(1, td // heads)
        src_head, heads_sent, dst_head = (unique * dst_heads) % src_heads, dst_heads, 0
    if heads_sent * bph > dst_token:
        raise LayoutError(f"head slice of {heads_sent * bph} bytes exceeds the destination's {dst_token} bytes per token")
    return HeadSlice(src_head, heads_sent, dst_head, bph, src_token, dst_token)


@dataclass(frozen=True)
class SidePairing:
    """The source's entries paired with one destination's, in planning order.

    ``kv_src``/``kv_dst`` and each ``state_src[c]``/``state_dst[c]`` are ``[n, 2]`` uint64 tables of
    ``(base_ptr, item_len)``; ``aux_*`` likewise.
    """

    mode: Mode
    kv_src: np.ndarray
    kv_dst: np.ndarray
    heads: HeadSlice | None
    state_src: tuple[np.ndarray, ...]
    state_dst: tuple[np.ndarray, ...]
    aux_src: np.ndarray
    aux_dst: np.ndarray
    state_heads: tuple[HeadSlice | None, ...] = ()  # per component: its head slice when head-sliced
    # per component: the bytes each (sliced) entry moves per item when its tables hold sliced
    # entries (TP-sliced Mamba state; docs/tp_state.md §4), else None (whole items)
    state_bytes: tuple[np.ndarray | None, ...] = ()
    # per component: the entry each row of its tables moves (sliced entries: several rows, or none,
    # per entry), else None (row i is entry i)
    state_rows: tuple[np.ndarray | None, ...] = ()
    # what planning derives from the two page sizes once (docs/page_sizes.md): KV moves in units of
    # ``unit_tokens`` (the gcd of the sides' page sizes), ``kv_units`` (source, destination) per page;
    # a paged component whose pages differ moves in units too, ``state_units[c]`` per page, else (1, 1)
    unit_tokens: int = 1
    kv_units: tuple[int, int] = (1, 1)
    state_units: tuple[tuple[int, int], ...] = ()
    # tokens per list element of head-sliced KV (one descriptor each: its unit), 0 when KV moves whole;
    # per component likewise (its page)
    sliced_tokens: int = 0
    state_sliced_tokens: tuple[int, ...] = ()

    @property
    def in_units(self) -> bool:
        """Whether KV or a paged component moves in units smaller than a page on either side."""
        return self.kv_units != (1, 1) or any(r != (1, 1) for r in self.state_units)

    def component_rows(self, c: int) -> np.ndarray:
        """The entry index of each row of component ``c``'s tables."""
        rows = self.state_rows[c] if c < len(self.state_rows) else None
        return np.arange(len(self.state_src[c])) if rows is None else rows

    def component_heads(self, c: int) -> HeadSlice | None:
        """Component ``c``'s head slice, or ``None`` when it moves whole (docs/tp_state.md)."""
        return self.state_heads[c] if c < len(self.state_heads) else None

    def component_bytes(self, c: int) -> np.ndarray | None:
        """Bytes per item of component ``c``'s sliced entries, or ``None`` when its entries move whole
        items (docs/tp_state.md §4)."""
        return self.state_bytes[c] if c < len(self.state_bytes) else None

    @property
    def per_item(self) -> bool:
        """Whether each descriptor is one per entry x item, as NIXL's prepared lists number them: whole items,
        or head slices of one span per page (``Attention.MHA_HEAD_MAJOR``: KV's and its head-sliced state's),
        with no TP-sliced state."""
        return (all(h is None or h.per_page for h in (self.heads, *self.state_heads))
                and all(b is None for b in self.state_bytes))

    @property
    def slices(self) -> bool:
        """Whether anything moves in parts of items: head-sliced KV or state, or sliced state entries."""
        return (self.heads is not None or any(h is not None for h in self.state_heads)
                or any(b is not None for b in self.state_bytes))


def _table(entries: list[Entry] | tuple[Entry, ...]) -> np.ndarray:
    return np.array([(e.base_ptr, e.item_len) for e in entries], dtype=np.uint64).reshape(-1, 2)


def _require_equal_items(what: str, src: tuple[Entry, ...], dst: tuple[Entry, ...]) -> None:
    if len(src) != len(dst):
        raise LayoutError(f"{what}: source has {len(src)} entries, destination {len(dst)}")
    for i, (s, d) in enumerate(zip(src, dst)):
        if s.item_len != d.item_len:
            raise LayoutError(f"{what} entry {i}: item lengths differ (source {s.item_len}, destination {d.item_len})")


def _require_equal_token_bytes(what: str, src: tuple[Entry, ...], dst: tuple[Entry, ...], ps_s: int, ps_d: int
                               ) -> None:
    """Entries of pages of ``ps_s`` and ``ps_d`` tokens hold the same bytes per token (docs/page_sizes.md)."""
    if len(src) != len(dst):
        raise LayoutError(f"{what}: source has {len(src)} entries, destination {len(dst)}")
    for i, (s, d) in enumerate(zip(src, dst)):
        if s.item_len * ps_d != d.item_len * ps_s:
            raise LayoutError(f"{what} entry {i}: bytes per token differ (source {s.item_len}/{ps_s}, "
                              f"destination {d.item_len}/{ps_d})")


_PAIRINGS: dict[tuple[int, int], tuple[SideMemory, SideMemory, SidePairing]] = {}
_PAIRINGS_KEPT = 64


def pair_sides(src: SideMemory, dst: SideMemory) -> SidePairing:
    """Pair a source side with a destination side, or raise :class:`LayoutError`.

    Sides are immutable, so the pairing of the same two side objects is computed once (a small
    cache keyed by identity, holding the sides so that their ids stay theirs).
    """
    key = (id(src), id(dst))
    hit = _PAIRINGS.get(key)
    if hit is not None and hit[0] is src and hit[1] is dst:
        return hit[2]
    pairing = _pair_sides(src, dst)
    if len(_PAIRINGS) >= _PAIRINGS_KEPT:
        _PAIRINGS.pop(next(iter(_PAIRINGS)))
    _PAIRINGS[key] = (src, dst, pairing)
    return pairing


_PACKED = (Attention.MHA_PACKED, Attention.MHA_HEAD_MAJOR)


def paired_attention(sk: KVLayout, dk: KVLayout) -> Attention:
    """The attention kind two sides' KV pair under: their own where it is the same. Packed KV of one head
    per rank is the same bytes with the heads inside or outside the tokens, so such a side pairs with a
    packed side of either kind under its peer's (a side of several heads decides).

    >>> one = KVLayout(Attention.MHA_PACKED, 16, (), num_kv_heads=8, tp_size=8)
    >>> paired_attention(one, KVLayout(Attention.MHA_HEAD_MAJOR, 16, (), num_kv_heads=8, tp_size=4)).value
    'mha-head-major'
    """
    if sk.attention is dk.attention:
        return sk.attention
    if sk.attention in _PACKED and dk.attention in _PACKED and sk.num_kv_heads and dk.num_kv_heads:
        src_heads, dst_heads = max(1, sk.num_kv_heads // sk.tp_size), max(1, dk.num_kv_heads // dk.tp_size)
        if min(src_heads, dst_heads) == 1:
            return sk.attention if src_heads > dst_heads else dk.attention if dst_heads > 1 else Attention.MHA_PACKED
    raise LayoutError(f"attention kinds differ: source {sk.attention.value}, destination {dk.attention.value}")


def _pair_sides(src: SideMemory, dst: SideMemory) -> SidePairing:
    sk, dk = src.kv, dst.kv
    kind = paired_attention(sk, dk)
    parts = kind.parts
    kv_src, kv_dst = [], []
    for part in range(parts):
        for local in range(sk.num_layers):
            layer = sk.first_layer + local
            kv_src.append(sk.entries[part * sk.num_layers + local])
            kv_dst.append(dk.entries[dk.entry_index(part, layer)])
    dst_ids = dk.model_layers
    for local, layer_id in enumerate(sk.model_layers):
        if layer_id != dst_ids[sk.first_layer + local - dk.first_layer]:
            raise LayoutError(f"KV layer {sk.first_layer + local}: its model-wide id differs (source {layer_id}, "
                              f"destination {dst_ids[sk.first_layer + local - dk.first_layer]}; KVLayout.layer_ids, "
                              "docs/layerwise.md)")
    mode = Mode.DIRECT if not kind.slices_heads or sk.tp_size == dk.tp_size else Mode.HEAD_SLICED
    heads = None
    if sk.page_size != dk.page_size and kind.heads_outside_tokens:
        raise LayoutError(f"KV pages of {sk.page_size} and {dk.page_size} tokens with the heads outside the tokens "
                          f"({kind.value}): a page's tokens are not one span, so the page sizes must be equal")
    if sk.page_size != dk.page_size and mode is Mode.DIRECT:
        _require_equal_token_bytes("KV", tuple(kv_src), tuple(kv_dst), sk.page_size, dk.page_size)
    elif mode is Mode.DIRECT:
        _require_equal_items("KV", tuple(kv_src), tuple(kv_dst))
    else:
        heads = _one_slice("KV", kv_src, kv_dst, sk, dk, None, kind.heads_outside_tokens)
    if len(src.state) != len(dst.state):
        raise LayoutError(f"state components differ: source has {len(src.state)}, destination {len(dst.state)}")
    state_heads: list[HeadSlice | None] = []
    state_src, state_dst = [_table(c.entries) for c in src.state], [_table(c.entries) for c in dst.state]
    state_bytes: list[np.ndarray | None] = [None] * len(src.state)
    state_rows: list[np.ndarray | None] = [None] * len(src.state)
    for i, (sc, dc) in enumerate(zip(src.state, dst.state)):
        if sc.kind is not dc.kind:
            raise LayoutError(f"state component {i}: kinds differ ({sc.kind.value} vs {dc.kind.value})")
        if sc.layers != dc.layers:
            raise LayoutError(f"state component {i} ({sc.name}): its entries' layers differ (source {sc.layers}, "
                              f"destination {dc.layers}); both sides must declare the same (docs/layerwise.md)")
        if sc.from_prefix != dc.from_prefix:
            raise LayoutError(f"state component {i} ({sc.name}): from_prefix is {sc.from_prefix} on the source and "
                              f"{dc.from_prefix} on the destination; both sides must start its lists alike "
                              "(planning.md §6)")
        rules = rules_of(sc.kind)
        cps_s, cps_d = sc.pages_of(sk.page_size), dc.pages_of(dk.page_size)
        if mode is Mode.HEAD_SLICED and rules.slices_heads:  # docs/tp_state.md
            state_heads.append(_component_slice(i, sc, dc, sk, dk, cps_s, cps_d, kind.heads_outside_tokens))
            continue
        state_heads.append(None)
        spans = any(shard.spans for shard in (*sc.shards, *dc.shards))  # (tensors in parts of items: moved as such)
        if rules.shards_tensors and (sk.tp_size != dk.tp_size or spans):  # docs/tp_state.md §4
            state_src[i], state_dst[i], state_bytes[i], state_rows[i] = sliced_entries(
                f"state component {i} ({sc.name})", sc, dc, sk, dk)
            continue
        if rules.paged and not rules.maps_pages and cps_s != cps_d:
            raise LayoutError(f"state component {i} ({sc.name}): its pages hold {cps_s} tokens on the source and "
                              f"{cps_d} on the destination; {sc.kind.value} state across page sizes is not planned "
                              "yet (docs/page_sizes.md §6)")
        if rules.paged and cps_s != cps_d:  # docs/page_sizes.md §6: moved in units; bytes per token must agree
            _require_equal_token_bytes(f"state component {i} ({sc.name})", sc.entries, dc.entries, cps_s, cps_d)
        else:
            try:
                _require_equal_items(f"state component {i} ({sc.name})", sc.entries, dc.entries)
            except LayoutError as err:
                if sk.tp_size != dk.tp_size and not rules.slices_heads:
                    raise LayoutError(f"{err}: {sc.kind.value} state is replicated on every rank and moved whole "
                                      f"between TP sizes {sk.tp_size} and {dk.tp_size}, so its items must be equal "
                                      "(docs/tp_state.md)") from None
                raise
    _require_equal_items("aux", src.aux, dst.aux)
    state_units = tuple(units_per_page(sc.pages_of(sk.page_size), dc.pages_of(dk.page_size))
                        if rules_of(sc.kind).paged else (1, 1) for sc, dc in zip(src.state, dst.state))
    return SidePairing(
        mode=mode,
        kv_src=_table(kv_src),
        kv_dst=_table(kv_dst),
        heads=heads,
        state_src=tuple(state_src),
        state_dst=tuple(state_dst),
        aux_src=_table(src.aux),
        aux_dst=_table(dst.aux),
        state_heads=tuple(state_heads),
        state_bytes=tuple(state_bytes),
        state_rows=tuple(state_rows),
        unit_tokens=gcd(sk.page_size, dk.page_size),
        kv_units=units_per_page(sk.page_size, dk.page_size),
        state_units=state_units,
        sliced_tokens=heads.spans_per_page(gcd(sk.page_size, dk.page_size)) if heads is not None else 0,
        state_sliced_tokens=tuple(0 if h is None else h.spans_per_page(sc.pages_of(sk.page_size))
                                  for h, sc in zip(state_heads, src.state)),
    )


def units_per_page(ps_s: int, ps_d: int) -> tuple[int, int]:
    """Units of ``gcd(ps_s, ps_d)`` tokens per page on each side (docs/page_sizes.md)."""
    unit = gcd(ps_s, ps_d)
    return ps_s // unit, ps_d // unit


def _component_slice(i: int, sc, dc, sk: KVLayout, dk: KVLayout, cps_s: int, cps_d: int, per_page: bool
                     ) -> HeadSlice:
    """The head slice of a head-sliced component (docs/tp_state.md §2), one for all its entries; ``per_page``:
    its pages hold each head's tokens in a row, as the KV's do (``Attention.MHA_HEAD_MAJOR``)."""
    what = f"state component {i} ({sc.name})"
    if cps_s != cps_d:
        raise LayoutError(f"{what}: head-sliced between TP sizes {sk.tp_size} and {dk.tp_size}, its pages must hold "
                          f"as many tokens on both sides (here {cps_s} and {cps_d}); not planned yet")
    if len(sc.entries) != len(dc.entries):
        raise LayoutError(f"{what}: source has {len(sc.entries)} entries, destination {len(dc.entries)}")
    try:
        return _one_slice("component", sc.entries, dc.entries, sk, dk, None if per_page else (cps_s, cps_d), per_page)
    except LayoutError as err:
        raise LayoutError(f"{what}: {err}") from None


def _one_slice(what: str, src: Sequence[Entry], dst: Sequence[Entry], sk: KVLayout, dk: KVLayout,
               pages: tuple[int, int] | None, per_page: bool = False) -> HeadSlice:
    """The one head slice every entry pair of ``what`` shares (planning.md §5), or LayoutError."""
    slices = {head_slice(sk, dk, s.item_len, d.item_len, pages, per_page) for s, d in zip(src, dst)}
    if len(slices) != 1:
        raise LayoutError(f"head-sliced mode needs the same item length on every {what} entry of a side")
    return slices.pop()


def smallest_descriptor(src: SideMemory, dsts: Sequence[SideMemory]) -> int:
    """The bytes of the smallest KV descriptor a batch from ``src`` to any of ``dsts`` makes: a page of one
    layer (one item), or one token's head slice where the two sides' TP sizes differ. A staged send's
    first gather is shaped for it before a batch has said otherwise."""
    sizes = []
    for dst in dsts:
        pairing = pair_sides(src, dst)
        sizes.append(pairing.heads.nbytes if pairing.heads is not None
                     else int(pairing.kv_src[:, 1].min()) if len(pairing.kv_src) else 4096)
    return max(1, min(sizes, default=4096))
