"""SGLang's ``KVArgs`` (``sglang.srt.disaggregation.base.conn``) as a kvplan :class:`SideMemory`.

SGLang registers, per side:

* ``kv_data_ptrs`` / ``kv_data_lens`` / ``kv_item_lens``: one buffer per KV entry, an item is a
  page. MHA lists every layer's K buffer, then every layer's V buffer; MLA one buffer per layer.
  kvplan's :class:`KVLayout` keeps the same entry order, so entries pair by position as SGLang's
  ``get_mha_kv_ptrs_with_pp`` pairs them.
* ``engine_rank``, ``total_kv_head_num`` (or ``kv_head_num`` per rank) and the attention TP size:
  where this rank sits for head-sliced transfers (planning.md §5). SGLang's decode names no head
  count: its side takes the prefill's when the two pair.
* ``aux_data_ptrs`` / ``aux_data_lens`` / ``aux_item_lens``: one row per request in each buffer.
* ``state_types`` with ``state_data_ptrs`` / ``state_data_lens`` / ``state_item_lens`` (lists of
  lists: one list of entries per component, the multi-component form) and, for Mamba,
  ``state_dim_per_tensor`` / ``state_slice_outer_counts`` / ``state_conv_shard_groups``: the state
  components, each Mamba entry with its :class:`~kvplan.planner.contract.batch.TensorShard`
  (docs/tp_state.md §4). What ``KVArgs`` does not hold (an SWA window, a ring's rows, a pool's page
  size, the slot map of the side whose lists are computed) comes per component in ``state_params``.

Nothing here imports SGLang: any object with these attributes will do.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Mapping, Sequence

from ...errors import LayoutError
from ...planner.contract.batch import Attention, Entry, KVLayout, SideMemory, StateComponent, StateKind, TensorShard
from ...planner.contract.state_kinds import rules_of

__all__ = ["DECODE_LENS", "aux_from_kv_args", "side_from_kv_args", "side_from_registration", "state_from_kv_args"]


def _entries(ptrs: Any, lens: Any, item_lens: Any, what: str) -> tuple[Entry, ...]:
    ptrs, lens, item_lens = list(ptrs or ()), list(lens or ()), list(item_lens or ())
    if not len(ptrs) == len(lens) == len(item_lens):
        raise LayoutError(f"KVArgs {what}: {len(ptrs)} pointers, {len(lens)} lengths and {len(item_lens)} item "
                          "lengths must be as many")
    return tuple(Entry.from_buffer(p, n, i) for p, n, i in zip(ptrs, lens, item_lens))


def aux_from_kv_args(kv_args: Any) -> tuple[Entry, ...]:
    """SGLang's aux buffers (one row per request in each) as kvplan entries, in ``KVArgs``' order."""
    return _entries(kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens, "aux")


def _per_component(kv_args: Any, name: str, count: int) -> list:
    values = list(getattr(kv_args, name, None) or ())
    return values + [None] * (count - len(values))


def state_from_kv_args(kv_args: Any, state_params: Sequence[Mapping[str, Any]] = ()) -> tuple[StateComponent, ...]:
    """The state components SGLang's ``KVArgs`` registers, in its order.

    ``state_params[i]`` gives component ``i`` what ``KVArgs`` does not hold, as
    :class:`StateComponent` keywords: ``window`` (SWA, SWA_RING), ``ring_size`` (SWA_RING),
    ``page_size`` (a pool paged unlike the KV), ``slot_map`` (on the side whose lists are computed),
    ``name``. A Mamba component's entries take their shards from ``state_dim_per_tensor`` (0:
    replicated), ``state_slice_outer_counts`` and ``state_conv_shard_groups``; without dims it has
    none, and moves only between equal TP sizes. A state type kvplan does not plan is a
    :class:`LayoutError` naming it.

    >>> from types import SimpleNamespace as NS
    >>> args = NS(state_types=["mamba"], state_data_ptrs=[[0x1000, 0x9000]], state_data_lens=[[4096] * 2],
    ...           state_item_lens=[[512, 256]], state_dim_per_tensor=[[64, 4]],
    ...           state_conv_shard_groups=[[[128, 128, 256], None]], state_slice_outer_counts=[[1, 1]])
    >>> mamba, = state_from_kv_args(args, [{"slot_map": [0, 3, 5]}])
    >>> [(e.item_len, e.num_items) for e in mamba.entries], mamba.shards[0].groups, mamba.shards[1].dim
    ([(512, 8), (256, 16)], (128, 128, 256), 4)
    """
    types = list(getattr(kv_args, "state_types", None) or ())
    params = list(state_params)
    if len(params) > len(types):
        raise LayoutError(f"{len(params)} state_params for {len(types)} state components of the KVArgs")
    params += [{}] * (len(types) - len(params))
    columns = {name: _per_component(kv_args, name, len(types))
               for name in ("state_data_ptrs", "state_data_lens", "state_item_lens", "state_dim_per_tensor",
                            "state_slice_outer_counts", "state_conv_shard_groups")}
    out = []
    for i, kind in enumerate(types):
        value = str(getattr(kind, "value", kind))
        try:
            kind = StateKind(value)
        except ValueError:
            raise LayoutError(f"KVArgs state component {i}: kvplan does not plan state type {value!r} (it plans "
                              f"{[k.value for k in StateKind]})") from None
        entries = _entries(columns["state_data_ptrs"][i], columns["state_data_lens"][i],
                           columns["state_item_lens"][i], f"state component {i} ({value})")
        shards: tuple[TensorShard, ...] = ()
        dims = list(columns["state_dim_per_tensor"][i] or ())
        if rules_of(kind).shards_tensors and dims:
            outer = list(columns["state_slice_outer_counts"][i] or ()) or [1] * len(dims)
            groups = list(columns["state_conv_shard_groups"][i] or ()) or [None] * len(dims)
            if not len(dims) == len(outer) == len(groups) == len(entries):
                raise LayoutError(f"KVArgs state component {i} ({value}): {len(entries)} entries, {len(dims)} dims, "
                                  f"{len(outer)} outer counts and {len(groups)} shard groups must be as many")
            shards = tuple(TensorShard(int(d), int(o), tuple(g or ())) for d, o, g in zip(dims, outer, groups))
        out.append(StateComponent(kind, entries, shards=shards, **dict(params[i])))
    return tuple(out)


def side_from_kv_args(kv_args: Any, *, mla: bool, attn_tp_size: int = 1, req_to_token: Any = None,
                      state: tuple[StateComponent, ...] | None = None,
                      state_params: Sequence[Mapping[str, Any]] = ()) -> SideMemory:
    """One side's registered memory, from SGLang's ``KVArgs`` of that side.

    Args:
        kv_args: SGLang's ``KVArgs`` (or anything with its attributes).
        mla: whether the KV pool is MLA (SGLang's ``is_mla_backend``): one entry per layer, never
            head-sliced.
        attn_tp_size: this side's attention TP size; ``kv_args.engine_rank`` is its rank there.
        req_to_token: the side's ``req_to_token`` table, on the side whose lists are computed.
        state: the side's state components; by default those the ``KVArgs`` register
            (:func:`state_from_kv_args`, completed by ``state_params``).
        state_params: per state component, what ``KVArgs`` does not hold (see
            :func:`state_from_kv_args`).

    >>> from types import SimpleNamespace as NS
    >>> args = NS(kv_data_ptrs=[0x1000, 0x9000], kv_data_lens=[0x8000] * 2, kv_item_lens=[0x800] * 2,
    ...           page_size=16, engine_rank=0, kv_head_num=2, total_kv_head_num=2, prefill_start_layer=0,
    ...           aux_data_ptrs=[0x20000], aux_data_lens=[4096], aux_item_lens=[64])
    >>> side = side_from_kv_args(args, mla=False)
    >>> side.kv.num_layers, side.kv.num_pages, side.aux[0].num_items
    (1, 16, 64)
    """
    total_heads = int(getattr(kv_args, "total_kv_head_num", 0) or 0)
    if total_heads <= 0:  # as SGLang's send_kvcache_slice: per-rank heads times the TP size; SGLang's decode
        # names neither (0: the side takes the prefill's count when they pair, as SGLang's prefill counts)
        total_heads = int(getattr(kv_args, "kv_head_num", 0) or 0) * attn_tp_size
    kv = KVLayout(Attention.MLA if mla else Attention.MHA, int(kv_args.page_size),
                  _entries(kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens, "KV"),
                  first_layer=int(getattr(kv_args, "prefill_start_layer", 0) or 0),
                  num_kv_heads=1 if mla else total_heads, tp_size=attn_tp_size,
                  tp_rank=int(kv_args.engine_rank) % attn_tp_size)
    aux = aux_from_kv_args(kv_args)
    if state is None:
        state = state_from_kv_args(kv_args, state_params)
    return SideMemory(kv, tuple(state), aux, req_to_token)


DECODE_LENS = ("kv_data_lens", "aux_data_lens", "state_data_lens")  # what an SGLang registration lacks


def side_from_registration(reg: Any, local_args: Any, decode_lens: Mapping[str, Any] | None, *, mla: bool,
                           attn_tp_size: int, state_params: Sequence[Mapping[str, Any]] = ()) -> SideMemory:
    """An SGLang decode rank's memory, from its registration (:class:`~.wire.Registration`) and what
    the registration does not carry.

    SGLang's registration holds the decode's base pointers, KV and state item lengths, TP place and
    Mamba slice dims, but no buffer lengths: ``decode_lens`` gives them, named as in the decode's own
    ``KVArgs`` (``kv_data_lens``, ``aux_data_lens``, ``state_data_lens``: :data:`DECODE_LENS`), so that
    every destination page is bounds-checked against the decode's pools. What SGLang's prefill takes
    from its own ``KVArgs`` comes from ``local_args`` (this prefill's): the page size, the model's
    KV head count, the aux item lengths, the state types, and the Mamba outer counts and conv groups.

    Raises :class:`LayoutError` naming what is missing or does not match (no lengths, or as many as
    the registration has buffers); ``attn_tp_size`` is this prefill's, to count the model's heads
    where ``local_args`` gives them per rank.

    >>> from types import SimpleNamespace as NS
    >>> reg = NS(kv_ptrs=(0x1000, 0x9000), kv_item_lens=(0x800, 0x800), aux_ptrs=(0x20000,), tp_rank=0,
    ...          attn_tp_size=1, state_ptrs=(), state_item_lens=(), state_dim_per_tensor=(), dcp_size=1)
    >>> local = NS(page_size=16, kv_head_num=2, total_kv_head_num=2, aux_item_lens=[64], state_types=[])
    >>> side = side_from_registration(reg, local, {"kv_data_lens": [0x8000] * 2, "aux_data_lens": [4096]},
    ...                               mla=False, attn_tp_size=1)
    >>> side.kv.num_pages, side.aux[0].num_items
    (16, 64)
    """
    if decode_lens is None:
        raise LayoutError("an SGLang decode rank registers no buffer lengths; give them (the decode's "
                          f"{', '.join(DECODE_LENS)}) so that its pages are bounds-checked")
    if int(getattr(reg, "dcp_size", 1) or 1) != 1:
        raise LayoutError(f"the decode rank uses decode context parallelism (dcp_size {reg.dcp_size}), which "
                          "kvplan does not plan")
    state_types = list(getattr(local_args, "state_types", None) or ())
    needed = DECODE_LENS if state_types else DECODE_LENS[:2]
    missing = [name for name in needed if name not in decode_lens]
    if missing:
        raise LayoutError(f"the decode's buffer lengths lack {missing}")
    if len(reg.state_ptrs) != len(state_types):
        raise LayoutError(f"the decode rank registers {len(reg.state_ptrs)} state components, this side "
                          f"{len(state_types)} ({[str(getattr(t, 'value', t)) for t in state_types]})")
    kv_lens = [int(n) for n in decode_lens["kv_data_lens"]]
    slots = getattr(reg, "num_slots", None)  # what a NIXL registration says the pool holds: it must agree
    if slots and kv_lens and min(n // int(i) for n, i in zip(kv_lens, reg.kv_item_lens)) != slots:
        raise LayoutError(f"the decode rank registers {slots} KV slots; the lengths given for it hold "
                          f"{min(n // int(i) for n, i in zip(kv_lens, reg.kv_item_lens))}")
    registered = [list(x) for x in getattr(reg, "state_data_lens", ()) or ()]
    if registered and registered != [[int(n) for n in x] for x in decode_lens.get("state_data_lens", ())]:
        raise LayoutError(f"the decode rank registers state buffer lengths {registered}; the lengths given for it "
                          f"are {decode_lens.get('state_data_lens')}")
    total_heads = int(getattr(local_args, "total_kv_head_num", 0) or 0) or int(local_args.kv_head_num) * attn_tp_size
    decode = SimpleNamespace(
        kv_data_ptrs=reg.kv_ptrs, kv_data_lens=decode_lens["kv_data_lens"], kv_item_lens=reg.kv_item_lens,
        page_size=local_args.page_size, engine_rank=reg.tp_rank, kv_head_num=0, total_kv_head_num=total_heads,
        prefill_start_layer=0, aux_data_ptrs=reg.aux_ptrs, aux_data_lens=decode_lens["aux_data_lens"],
        aux_item_lens=local_args.aux_item_lens, state_types=state_types, state_data_ptrs=reg.state_ptrs,
        state_data_lens=decode_lens.get("state_data_lens", ()), state_item_lens=reg.state_item_lens,
        state_dim_per_tensor=reg.state_dim_per_tensor,
        state_slice_outer_counts=getattr(local_args, "state_slice_outer_counts", None),
        state_conv_shard_groups=getattr(local_args, "state_conv_shard_groups", None))
    return side_from_kv_args(decode, mla=mla, attn_tp_size=int(reg.attn_tp_size), state_params=state_params)
