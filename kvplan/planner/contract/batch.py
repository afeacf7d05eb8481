"""The data model a plan is built from: each side's memory and a batch of transfers.

The names follow ``docs/planning.md``:

* an :class:`Entry` is one registered buffer addressed in items (pages): page ``p`` starts at
  ``base_ptr + p * item_len``;
* a :class:`KVLayout` is a side's KV pool: its entries in planning order (MHA ``K_0..K_{n-1},
  V_0..V_{n-1}``; MLA ``KV_0..KV_{n-1}``), page size, pipeline layer range and attention-TP place;
* a :class:`StateComponent` is one hybrid-model state (SWA, DSA, SWA_RING, MAMBA) with its own
  entries and parameters; both sides list their components in the same order;
* a :class:`SideMemory` groups a side's KV layout, components, aux buffers and token table;
* a :class:`Transfer` is one chunk of one request to one destination; a :class:`Batch` is the list
  of transfers planned together.

Example::

    import numpy as np
    from kvplan.planner.contract.batch import Attention, Batch, Entry, KVLayout, SideMemory, Transfer

    def mha(base):  # 2 layers: K0, K1, V0, V1; 64 pages of 4096 bytes each
        return KVLayout(Attention.MHA, page_size=16,
                        entries=tuple(Entry(base + i * (1 << 20), 4096, 64) for i in range(4)))

    table = np.zeros((4, 256), np.int32)
    table[1, :64] = np.arange(16 * 16, 16 * 20)          # request in row 1 holds pages 16..19
    src = SideMemory(mha(0x10000000), req_to_token=table)
    dst = SideMemory(mha(0x90000000))
    batch = Batch(src=src, dsts=(dst,), transfers=(
        Transfer("req-1", src_row=1, start=0, fill_len=64, prompt_len=64, last=True,
                 dst_pages=np.array([3, 4, 9, 10])),))
"""

from __future__ import annotations

import enum
from functools import cached_property
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from ...errors import InputError, LayoutError

__all__ = [
    "Attention",
    "Batch",
    "Entry",
    "KVLayout",
    "Policy",
    "SideMemory",
    "StateComponent",
    "StateKind",
    "TensorShard",
    "Transfer",
]



_KIND_RULES: list = []  # the kinds' rules, registered by .state_kinds (they build on this module; no import back)


def use_kind_rules(lookup: Any) -> None:
    """Register how a state kind's rules are found (``kvplan.planner.contract.state_kinds.rules_of``; the
    planner package imports that module, so it is registered before any component is made)."""
    _KIND_RULES[:] = [lookup]


def kind_rules(kind: Any) -> Any:
    """The rules of ``kind`` (``state_kinds.KindRules``), through the registered lookup."""
    if not _KIND_RULES:
        raise LayoutError("no state-kind rules are registered: import kvplan.planner (it registers "
                          "kvplan.planner.contract.state_kinds)")
    return _KIND_RULES[0](kind)

class Policy(str, enum.Enum):
    """How list-length mismatches are handled (planning.md §3, §4, §6)."""

    STRICT = "strict"
    """Reject the request with an error that names it (the default)."""
    TRUNCATE = "truncate"
    """SGLang's behaviour: truncate the longer list and log a warning."""


class Attention(str, enum.Enum):
    """How a layer's KV lies in a side's pools:

    * ``MHA``: a K and a V entry per layer (SGLang's pools); between TP sizes each rank moves its heads;
    * ``MHA_PACKED``: one entry per layer whose tokens hold each head's K and V side by side (vLLM's
      blocks with the tokens outside the heads), moved by head like ``MHA``;
    * ``MHA_HEAD_MAJOR``: one entry per layer whose pages hold each head's tokens, K and V side by side, in a
      row (vLLM's blocks with the heads outside the tokens, ``LBHNC``): between TP sizes a rank's heads of a
      page are one span, moved as one descriptor per layer x page;
    * ``MLA``: one latent entry per layer, the same on every rank.
    """

    MHA = "mha"
    MLA = "mla"
    MHA_PACKED = "mha-packed"
    MHA_HEAD_MAJOR = "mha-head-major"

    @property
    def parts(self) -> int:
        """Entries per layer (K and V, or one)."""
        return 2 if self is Attention.MHA else 1

    @property
    def slices_heads(self) -> bool:
        """Whether sides of different TP sizes move it head by head (planning.md §5)."""
        return self is not Attention.MLA

    @property
    def heads_outside_tokens(self) -> bool:
        """Whether a page holds each head's tokens in a row (a head slice is one span per page, and a page's
        tokens are not one span: the two sides' page sizes must be equal)."""
        return self is Attention.MHA_HEAD_MAJOR


class StateKind(str, enum.Enum):
    """A hybrid-model state kind; each has its rules in :mod:`kvplan.planner.contract.state_kinds`."""

    SWA = "swa"
    DSA = "dsa"
    SWA_RING = "swa_ring"
    MAMBA = "mamba"


@dataclass(frozen=True)
class Entry:
    """One registered buffer, addressed in items of ``item_len`` bytes.

    ``num_items`` is the pool size in items (``data_len // item_len``).
    """

    base_ptr: int
    item_len: int
    num_items: int

    def __post_init__(self) -> None:
        if self.base_ptr < 0 or self.base_ptr >= 1 << 64:
            raise LayoutError(f"entry base_ptr {self.base_ptr:#x} is not an unsigned 64-bit address")
        if self.item_len <= 0:
            raise LayoutError(f"entry item_len must be positive, got {self.item_len}")
        if self.num_items < 0:
            raise LayoutError(f"entry num_items must be >= 0, got {self.num_items}")

    @classmethod
    def from_buffer(cls, base_ptr: int, data_len: int, item_len: int) -> "Entry":
        """An entry over ``data_len`` bytes; the pool holds ``data_len // item_len`` items."""
        return cls(int(base_ptr), int(item_len), int(data_len) // int(item_len))

    @classmethod
    def from_tensor(cls, tensor: Any, tokens_per_item: int) -> "Entry":
        """An entry over a contiguous tensor whose first dimension indexes tokens or pages.

        ``tokens_per_item`` says which: the page size for a token-indexed buffer (SGLang's
        ``k_buffer`` is ``[tokens, heads, dim]``: an item is ``page_size`` rows), or 1 for a buffer
        already indexed by page (``[pages, page_size, heads, dim]``) or by slot (Mamba, aux). It is
        required because the two layouts cannot be told apart from the tensor.

        Example::

            k_buffer = torch.zeros(64, 8, 128, dtype=torch.bfloat16)   # [tokens, heads, dim]
            Entry.from_tensor(k_buffer, tokens_per_item=16)             # 4 pages of 32768 bytes
        """
        if not tensor.is_contiguous():
            raise LayoutError("entry tensors must be contiguous")
        if tokens_per_item < 1 or tensor.shape[0] % tokens_per_item:
            raise LayoutError(f"a tensor of {tensor.shape[0]} rows does not hold whole items of {tokens_per_item} rows")
        item_len = tensor.stride(0) * tensor.element_size() * tokens_per_item
        return cls(int(tensor.data_ptr()), int(item_len), int(tensor.shape[0]) // tokens_per_item)


@dataclass(frozen=True)
class KVLayout:
    """A side's KV pool (planning.md §1) and its attention-TP place (§5).

    Attributes:
        attention: MHA (K and V entries) or MLA (one KV entry per layer).
        page_size: tokens per page.
        entries: the KV entries in planning order.
        first_layer: first layer this side holds (pipeline parallelism).
        num_kv_heads: total KV heads of the model (``H``), used by head slicing; 0 where this side
            does not know it (SGLang's decode ``KVArgs`` name none): the side takes its peer's count
            when the two pair (:func:`kvplan.transport.registration.with_model_heads`).
        tp_size: attention-TP size of this side.
        tp_rank: this rank within its attention-TP group.
        layer_ids: the model-wide layer id of each local layer, for streaming in layer groups
            (docs/layerwise.md); empty means ``first_layer + i``. A hybrid model whose attention
            layers are every fourth layer names them here (SGLang's ``kv_layer_ids``).
    """

    attention: Attention
    page_size: int
    entries: tuple[Entry, ...]
    first_layer: int = 0
    num_kv_heads: int = 1
    tp_size: int = 1
    tp_rank: int = 0
    layer_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", Attention(self.attention))
        object.__setattr__(self, "entries", tuple(self.entries))
        object.__setattr__(self, "layer_ids", tuple(int(i) for i in self.layer_ids))
        if self.layer_ids and (len(self.layer_ids) != self.num_layers
                               or any(b <= a for a, b in zip(self.layer_ids, self.layer_ids[1:]))):
            raise LayoutError(f"layer_ids must name each of the {self.num_layers} layers once, in increasing order; "
                              f"got {self.layer_ids}")
        if self.page_size < 1:
            raise LayoutError(f"page_size must be >= 1, got {self.page_size}")
        if len(self.entries) % self.attention.parts:
            raise LayoutError(f"an MHA layout needs K and V entries, got {len(self.entries)} entries")
        if not 0 <= self.tp_rank < self.tp_size:
            raise LayoutError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        if self.num_kv_heads < 0 or self.first_layer < 0:
            raise LayoutError("num_kv_heads must be >= 0 (0: not known yet) and first_layer >= 0")

    @property
    def num_layers(self) -> int:
        return len(self.entries) // self.attention.parts

    @property
    def model_layers(self) -> tuple[int, ...]:
        """The model-wide id of each local layer (``layer_ids``, or ``first_layer + i``)."""
        return self.layer_ids or tuple(range(self.first_layer, self.first_layer + self.num_layers))

    @cached_property
    def num_pages(self) -> int:
        """Pool size in pages: the smallest entry bounds it."""
        return min((e.num_items for e in self.entries), default=0)

    def entry_index(self, part: int, layer: int) -> int:
        """Index in ``entries`` of part ``part`` (0 = K or KV, 1 = V) of global layer ``layer``."""
        local = layer - self.first_layer
        if not 0 <= local < self.num_layers:
            raise LayoutError(
                f"layer {layer} is outside this side's layers "
                f"[{self.first_layer}, {self.first_layer + self.num_layers})"
            )
        return part * self.num_layers + local


@dataclass(frozen=True)
class TensorShard:
    """How one state entry's item is sharded across attention-TP ranks (docs/tp_state.md §4).

    An item is ``outer`` rows, each holding this rank's ``dim`` positions of the sharded dimension
    (``item_len = outer * dim * unit`` bytes). ``dim = 0`` marks an item replicated on every rank.
    ``groups`` are the full (unsharded) sizes of sub-blocks sharded each on its own, in item order
    (GDN's ``conv_state`` is ``query | key | value``); empty means one block of ``dim * tp_size``.

    ``offset`` and ``nbytes`` say where the tensor lies in an item that holds more than it (vLLM's Mamba
    page: the conv state, then the temporal state, then padding; two entries over the same memory, one per
    tensor); ``nbytes = 0`` means the whole item. An entry whose shard names a span moves that span only,
    between equal TP sizes too.

    Example: Qwen3-Next's GDN layer on TP 8, ``conv_state [slots, 8192 / 8, 3]`` in bf16 and
    ``temporal_state [slots, 32 / 8, 128, 128]`` in fp32::

        conv = TensorShard(dim=1024, groups=(2048, 2048, 4096))
        temporal = TensorShard(dim=4)
        in_a_page = TensorShard(dim=4, offset=6144, nbytes=262144)   # the temporal state after the conv's
    """

    dim: int
    outer: int = 1
    groups: tuple[int, ...] = ()
    offset: int = 0
    nbytes: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(int(g) for g in self.groups))
        if self.dim < 0 or self.outer < 1 or any(g < 1 for g in self.groups):
            raise LayoutError(f"a tensor shard needs dim >= 0, outer >= 1 and positive groups, got {self}")
        if self.offset < 0 or self.nbytes < 0 or (self.offset and not self.nbytes):
            raise LayoutError(f"a tensor shard's span needs offset >= 0 and, with an offset, nbytes > 0; got {self}")

    @property
    def spans(self) -> bool:
        """Whether the tensor is a span of its item (``nbytes`` given), not the whole item."""
        return self.nbytes > 0

    @property
    def replicated(self) -> bool:
        return self.dim == 0


@dataclass(frozen=True)
class StateComponent:
    """One state component of a hybrid model (planning.md §6), as one side holds it.

    Attributes:
        kind: SWA, DSA, SWA_RING or MAMBA.
        entries: this component's own entries, each with its own item length.
        window: sliding window ``W`` in tokens (SWA, SWA_RING).
        page_size: page size of the component's pool (SWA, DSA); ``None`` = the side's page size.
        ring_size: ring rows per request ``R`` (SWA_RING).
        slot_map: SWA: ``full_to_swa`` (int64, full slot -> SWA slot, 0 = none);
            MAMBA: row -> Mamba slot. A host array or a tensor on the planning device; needed on
            the side whose lists are computed, not in a description of the peer.
        name: an id for messages and for completion tracking (defaults to the kind).
        shards: MAMBA: per entry, how its item is sharded across attention-TP ranks
            (:class:`TensorShard`); required to move the component between different TP sizes
            (docs/tp_state.md §4), ignored between equal ones.
        layers: per entry, the model-wide layer it belongs to (SGLang's ``state_layer_ids``), for
            streaming in layer groups (docs/layerwise.md); empty: the component moves with the
            last group. Both sides must declare the same.
        from_prefix: SGLang 0.5.23's lists after a decode prefix ``P`` (SWA and DSA only): the SWA
            window starts at ``max(P, seq - W)`` and the DSA pages cover ``[P, seq)``, so the
            decode side's cached prefix is not sent again. Off (planning.md §6): both start at 0.
            Both sides must declare the same.
    """

    kind: StateKind
    entries: tuple[Entry, ...]
    window: int = 0
    page_size: int | None = None
    ring_size: int = 0
    slot_map: Any = None
    name: str = ""
    shards: tuple[TensorShard, ...] = ()
    layers: tuple[int, ...] = ()
    from_prefix: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", StateKind(self.kind))
        object.__setattr__(self, "from_prefix", bool(self.from_prefix))
        object.__setattr__(self, "entries", tuple(self.entries))
        object.__setattr__(self, "shards", tuple(self.shards))
        object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        if self.layers and len(self.layers) != len(self.entries):
            raise LayoutError(f"component {self.name or self.kind.value}: {len(self.layers)} layer ids for "
                              f"{len(self.entries)} entries (one per entry)")
        if self.shards and len(self.shards) != len(self.entries):
            raise LayoutError(f"component {self.name or self.kind.value}: {len(self.shards)} shards for "
                              f"{len(self.entries)} entries (one per entry)")
        if not self.name:
            object.__setattr__(self, "name", self.kind.value)
        kind_rules(self.kind).validate(self)
        if self.page_size is not None and self.page_size < 1:
            raise LayoutError(f"component {self.name}: page_size must be >= 1")

    @cached_property
    def num_items(self) -> int:
        return min((e.num_items for e in self.entries), default=0)

    def require_map(self) -> None:
        """Raise unless the component has the slot map its lists are computed through.

        A peer's components are described without maps (they are only needed by the side that
        computes its own lists), so the check happens where lists are computed.
        """
        kind_rules(self.kind).require_map(self)

    def pages_of(self, side_page_size: int) -> int:
        return self.page_size or side_page_size


@dataclass(frozen=True)
class SideMemory:
    """Everything one side registers: KV layout, state components (in order), aux buffers.

    ``req_to_token`` (int32 ``[rows, max_ctx]``) is needed on the side whose lists are computed:
    the source when planning a batch, the destination when computing its destination lists.
    """

    kv: KVLayout
    state: tuple[StateComponent, ...] = ()
    aux: tuple[Entry, ...] = ()
    req_to_token: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", tuple(self.state))
        object.__setattr__(self, "aux", tuple(self.aux))

    def to(self, device: Any) -> "SideMemory":
        """The same side with its token table and slot maps as torch tensors on ``device``."""
        import torch

        def move(values: Any) -> Any:
            return None if values is None else torch.as_tensor(values).to(device)

        state = tuple(replace(c, slot_map=move(c.slot_map)) for c in self.state)
        return replace(self, state=state, req_to_token=move(self.req_to_token))


def _index_array(values: Any) -> np.ndarray:
    """A host int64 copy of an index list (list, NumPy array or CPU tensor)."""
    if hasattr(values, "detach"):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"index lists must be 1-D integer arrays, got {arr.dtype} {arr.shape}")
    return arr.astype(np.int64, copy=False)


@dataclass(frozen=True)
class Transfer:
    """One chunk of one request to one destination.

    Attributes:
        request: the request's id (named in every error about it).
        src_row: the request's row in the source token table.
        start: first token of the chunk; page aligned; ``prefix_len`` for the first chunk.
        fill_len: tokens prefilled so far (may include the sampled token).
        prompt_len: ``L``.
        last: the scheduler's flag: this chunk finishes the request's prefill.
        dst_pages: the destination's page list for ``[prefix_len, prompt_len)``, whole; the chunk
            takes its slice from the cursor ``(start - prefix_len) // page_size``.
        prefix_len: ``P``, tokens the destination already holds (page aligned).
        aux_src, aux_dst: aux indices on each side (used on the last chunk).
        dst_state: the destination's index list per state component, in component order (used
            on the last chunk).
        dest: index of the destination in :attr:`Batch.dsts`.
    """

    request: Any
    src_row: int
    start: int
    fill_len: int
    prompt_len: int
    last: bool
    dst_pages: Any
    prefix_len: int = 0
    aux_src: int = -1
    aux_dst: int = -1
    dst_state: tuple[Any, ...] = ()
    dest: int = 0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "dst_pages", _index_array(self.dst_pages))
            object.__setattr__(self, "dst_state", tuple(_index_array(x) for x in self.dst_state))
        except TypeError as err:
            raise InputError(self.request, str(err)) from None


@dataclass(frozen=True)
class Batch:
    """Transfers planned together, from one source to one or more destinations.

    Attributes:
        src: the planning side's memory (with its token table).
        dsts: the destinations' memory, indexed by :attr:`Transfer.dest`.
        transfers: the chunks to plan, in order.
        policy: ``strict`` (default) or ``truncate``.
        validate: check the allocator invariant of every sent page (planning.md §2).
    """

    src: SideMemory
    dsts: Sequence[SideMemory]
    transfers: Sequence[Transfer]
    policy: Policy = Policy.STRICT
    validate: bool = True

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "policy", Policy(self.policy))
        except ValueError:
            raise InputError(None, f"policy must be one of {[p.value for p in Policy]}, got {self.policy!r}") from None
        object.__setattr__(self, "dsts", tuple(self.dsts))
        object.__setattr__(self, "transfers", tuple(self.transfers))

    def to(self, device: Any) -> "Batch":
        """The same batch with the source's token table and slot maps on ``device``."""
        return replace(self, src=self.src.to(device))
