"""A side's registration as the peer sees it: entries, page size, components, aux (no token table).

The decode side publishes :func:`describe_side`; the prefill side rebuilds it with
:func:`side_from_description` and pairs it with its own side (which raises
:class:`~kvplan.errors.LayoutError` when the two cannot pair: page size, entry counts, item lengths).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..planner.contract.batch import Attention, Entry, KVLayout, SideMemory, StateComponent, StateKind, TensorShard

__all__ = ["describe_side", "side_from_description", "with_model_heads"]


def _entries(entries: tuple[Entry, ...]) -> list[list[int]]:
    return [[e.base_ptr, e.item_len, e.num_items] for e in entries]


def _from_entries(rows: list[list[int]]) -> tuple[Entry, ...]:
    return tuple(Entry(int(b), int(i), int(n)) for b, i, n in rows)


def describe_side(side: SideMemory) -> dict[str, Any]:
    kv = side.kv
    return {
        "kv": {"attention": kv.attention.value, "page_size": kv.page_size, "entries": _entries(kv.entries),
               "first_layer": kv.first_layer, "num_kv_heads": kv.num_kv_heads, "tp_size": kv.tp_size,
               "tp_rank": kv.tp_rank, "layer_ids": list(kv.layer_ids)},
        "state": [{"kind": c.kind.value, "name": c.name, "entries": _entries(c.entries), "window": c.window,
                   "page_size": c.page_size, "ring_size": c.ring_size,
                   "shards": [[s.dim, s.outer, list(s.groups), s.offset, s.nbytes] for s in c.shards],
                   "layers": list(c.layers),
                   "from_prefix": c.from_prefix}
                  for c in side.state],
        "aux": _entries(side.aux),
    }


def _shard(dim: int, outer: int, groups: list, offset: int = 0, nbytes: int = 0) -> TensorShard:
    """A tensor shard as a peer describes it (a peer before session 43 names no span: the whole item)."""
    return TensorShard(int(dim), int(outer), tuple(int(g) for g in groups), int(offset), int(nbytes))


def side_from_description(desc: dict[str, Any]) -> SideMemory:
    kv = desc["kv"]
    layout = KVLayout(Attention(kv["attention"]), kv["page_size"], _from_entries(kv["entries"]), kv["first_layer"],
                      kv["num_kv_heads"], kv["tp_size"], kv["tp_rank"], tuple(kv.get("layer_ids", ())))
    state = tuple(StateComponent(StateKind(c["kind"]), _from_entries(c["entries"]), c["window"], c["page_size"],
                                 c["ring_size"], None, c["name"],
                                 tuple(_shard(*shard) for shard in c.get("shards", ())),
                                 tuple(c.get("layers", ())), bool(c.get("from_prefix", False)))
                  for c in desc["state"])
    return SideMemory(layout, state, _from_entries(desc["aux"]))


def with_model_heads(side: SideMemory, num_kv_heads: int) -> SideMemory:
    """``side`` with the model's KV head count where it names none (0: SGLang's decode ``KVArgs`` carry
    no head count, as SGLang's own decode managers need none: the prefill counts a decode rank's heads
    from its own). A side that names its count keeps it; pairing checks that the two agree, and head
    slicing checks every item length against the count.

    >>> from kvplan.planner.contract.batch import Attention, KVLayout, SideMemory
    >>> with_model_heads(SideMemory(KVLayout(Attention.MHA, 16, (), num_kv_heads=0)), 8).kv.num_kv_heads
    8
    """
    if side.kv.num_kv_heads or not num_kv_heads:
        return side
    return replace(side, kv=replace(side.kv, num_kv_heads=int(num_kv_heads)))
