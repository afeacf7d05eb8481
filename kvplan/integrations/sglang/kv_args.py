"""SGLang's ``KVArgs`` (``sglang.srt.disaggregation.base.conn``) as a kvplan :class:`SideMemory`.

SGLang registers, per side:

* ``kv_data_ptrs`` / ``kv_data_lens`` / ``kv_item_lens``: one buffer per KV entry, an item is a
  page. MHA lists every layer's K buffer, then every layer's V buffer; MLA one buffer per layer.
  kvplan's :class:`KVLayout` keeps the same entry order, so entries pair by position as SGLang's
  ``get_mha_kv_ptrs_with_pp`` pairs them.
* ``engine_rank``, ``total_kv_head_num`` (or ``kv_head_num`` per rank) and the attention TP size:
  where this rank sits for head-sliced transfers (planning.md §5).
* ``aux_data_ptrs`` / ``aux_data_lens`` / ``aux_item_lens``: one row per request in each buffer.

Nothing here imports SGLang: any object with these attributes will do.
"""

from __future__ import annotations

from typing import Any

from ...errors import LayoutError
from ...planner.model import Attention, Entry, KVLayout, SideMemory, StateComponent

__all__ = ["side_from_kv_args"]


def _entries(ptrs: Any, lens: Any, item_lens: Any, what: str) -> tuple[Entry, ...]:
    ptrs, lens, item_lens = list(ptrs or ()), list(lens or ()), list(item_lens or ())
    if not len(ptrs) == len(lens) == len(item_lens):
        raise LayoutError(f"KVArgs {what}: {len(ptrs)} pointers, {len(lens)} lengths and {len(item_lens)} item "
                          "lengths must be as many")
    return tuple(Entry.from_buffer(p, n, i) for p, n, i in zip(ptrs, lens, item_lens))


def side_from_kv_args(kv_args: Any, *, mla: bool, attn_tp_size: int = 1, req_to_token: Any = None,
                      state: tuple[StateComponent, ...] = ()) -> SideMemory:
    """One side's registered memory, from SGLang's ``KVArgs`` of that side.

    Args:
        kv_args: SGLang's ``KVArgs`` (or anything with its attributes).
        mla: whether the KV pool is MLA (SGLang's ``is_mla_backend``): one entry per layer, never
            head-sliced.
        attn_tp_size: this side's attention TP size; ``kv_args.engine_rank`` is its rank there.
        req_to_token: the side's ``req_to_token`` table, on the side whose lists are computed.
        state: the side's state components.

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
    return SideMemory(kv, tuple(state), aux, req_to_token)
