"""SGLang's ``KVArgs`` (``sglang.srt.disaggregation.base.conn``) as a kvplan :class:`SideMemory`.

SGLang registers, per side:

* ``kv_data_ptrs`` / ``kv_data_lens`` / ``kv_item_lens``: one buffer per KV entry, an item is a
  page. MHA lists every layer's K buffer, then every layer's V buffer; MLA one buffer per layer.
  kvplan's :class:`KVLayout` keeps the same entry order, so entries pair by position as SGLang's
  ``get_mha_kv_ptrs_with_pp`` pairs them.
* ``engine_rank``, ``total_kv_head_num`` (or ``kv_head_num`` per rank) and the attention TP size:
  where this rank sits for head-sliced transfers (planning.md §5).
* ``aux_data_ptrs`` / ``aux_data_lens`` / ``aux_item_lens``: one row per request in each buffer.
* ``state_types`` with ``state_data_ptrs`` / ``state_data_lens`` / ``state_item_lens`` (lists of
  lists: one list of entries per component, the multi-component form) and, for Mamba,
  ``state_dim_per_tensor`` / ``state_slice_outer_counts`` / ``state_conv_shard_groups``: the state
  components, each Mamba entry with its :class:`~kvplan.planner.model.TensorShard`
  (docs/tp_state.md §4). What ``KVArgs`` does not hold (an SWA window, a ring's rows, a pool's page
  size, the slot map of the side whose lists are computed) comes per component in ``state_params``.

Nothing here imports SGLang: any object with these attributes will do.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ...errors import LayoutError
from ...planner.model import Attention, Entry, KVLayout, SideMemory, StateComponent, StateKind, TensorShard
from ...planner.state_kinds import rules_of

__all__ = ["side_from_kv_args", "state_from_kv_args"]


def _entries(ptrs: Any, lens: Any, item_lens: Any, what: str) -> tuple[Entry, ...]:
    ptrs, lens, item_lens = list(ptrs or ()), list(lens or ()), list(item_lens or ())
    if not len(ptrs) == len(lens) == len(item_lens):
        raise LayoutError(f"KVArgs {what}: {len(ptrs)} pointers, {len(lens)} lengths and {len(item_lens)} item "
                          "lengths must be as many")
    return tuple(Entry.from_buffer(p, n, i) for p, n, i in zip(ptrs, lens, item_lens))


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
    if total_heads <= 0:  # as SGLang's send_kvcache_slice: per-rank heads times the TP size
        total_heads = int(kv_args.kv_head_num) * attn_tp_size
    kv = KVLayout(Attention.MLA if mla else Attention.MHA, int(kv_args.page_size),
                  _entries(kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens, "KV"),
                  first_layer=int(getattr(kv_args, "prefill_start_layer", 0) or 0),
                  num_kv_heads=1 if mla else total_heads, tp_size=attn_tp_size,
                  tp_rank=int(kv_args.engine_rank) % attn_tp_size)
    aux = _entries(kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens, "aux")
    if state is None:
        state = state_from_kv_args(kv_args, state_params)
    return SideMemory(kv, tuple(state), aux, req_to_token)
