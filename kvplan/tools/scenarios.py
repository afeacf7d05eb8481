"""Synthetic batches shaped like real models, on fragmented pools (benchmarks.md "Scenarios").

Used by ``kvplan demo``, the benchmarks and the tests. A scenario allocates pages from a free
list built of runs of geometric length (mean ``mean_run`` pages), shuffled, independently on the
source and the destination, from a fixed seed. Page 0 and row 0 are never used.

Example::

    from kvplan.tools.scenarios import PRESETS, build_batch
    batch = build_batch(PRESETS["llama70b-tp8-p64"].scaled(layers=4), requests=2, prompt_len=1000)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from math import gcd

import numpy as np

from ..planner.contract.batch import Attention, Batch, Entry, KVLayout, Policy, SideMemory, StateComponent, StateKind, TensorShard, Transfer
from ..planner.reference.oracle import destination_lists
from ..planner.contract.rules import cdiv
from ..planner.contract.tensor_slices import partner_rank

if TYPE_CHECKING:
    import torch

__all__ = ["ComponentShape", "ModelShape", "PRESETS", "SCENARIOS", "Scenario", "scenarios_table", "ShardedTensor", "build_batch", "fragmented_free_list",
           "materialize", "paired_ranks"]


@dataclass(frozen=True)
class ShardedTensor:
    """One per-layer tensor of TP-sharded state (Mamba; docs/tp_state.md §4), for the whole model:
    ``full_dim`` positions of the sharded dimension (0: replicated), ``unit`` bytes per position
    and row, ``outer`` rows, ``groups`` the sub-blocks sharded each on its own."""

    full_dim: int
    unit: int
    outer: int = 1
    groups: tuple[int, ...] = ()

    def on(self, tp: int) -> tuple[int, TensorShard]:
        """``(item_len, shard)`` on a rank of attention-TP size ``tp``."""
        dim = self.full_dim // tp
        return self.outer * max(dim, 1) * self.unit, TensorShard(dim, self.outer, self.groups)


@dataclass(frozen=True)
class ComponentShape:
    """A state component's shape; with ``tensors`` (Mamba), entry ``i`` is ``tensors[i % len]`` and
    its item follows each side's TP size (``item_len`` is then unused).

    Its entries' layers (for streaming in layer groups) spread over the model's: ``parts`` part-major
    halves (SWA's ``K_0.., V_0..``) or, with ``tensors``, one run of tensors per layer.
    """

    kind: StateKind
    entries: int
    item_len: int
    window: int = 0
    ring_size: int = 0
    tensors: tuple[ShardedTensor, ...] = ()
    parts: int = 1
    name: str = ""  # the component's id (StateComponent.name; empty: its kind's)
    from_prefix: bool = False  # SWA, DSA: SGLang's lists after a decode prefix (StateComponent.from_prefix)

    def layers(self, model_layers: int) -> tuple[int, ...]:
        """The model-wide layer of each entry, spread evenly over ``model_layers`` layers."""
        per_layer = len(self.tensors) or 1
        parts = self.parts if self.entries % self.parts == 0 else 1
        own = max(1, self.entries // (per_layer * parts))  # this component's layers
        return tuple(((i // per_layer) % own) * model_layers // own for i in range(self.entries))


@dataclass(frozen=True)
class ModelShape:
    """A model's per-rank memory shape; ``src_tp``/``dst_tp`` differ for head slicing."""

    name: str
    attention: Attention
    layers: int
    token_bytes: int  # bytes per token per entry on the destination
    page_size: int
    state: tuple[ComponentShape, ...] = ()
    num_kv_heads: int = 1
    src_tp: int = 1
    dst_tp: int = 1
    mean_run: float = 4.0
    aux_items: tuple[int, ...] = (8, 64)

    def scaled(self, layers: int | None = None, page_size: int | None = None) -> "ModelShape":
        """The same model with fewer layers (and components scaled alike) or another page size."""
        layers = layers or self.layers
        page_size = page_size or self.page_size
        state = tuple(replace(c, entries=max(1, c.entries * layers // self.layers),
                              item_len=c.item_len * page_size // self.page_size
                              if c.kind in (StateKind.SWA, StateKind.DSA) else c.item_len)  # per page of the side
                      for c in self.state)
        return replace(self, layers=layers, state=state, page_size=page_size)

    def from_prefix(self) -> "ModelShape":
        """The same model with every SWA and DSA component in planning.md §6's ``from_prefix``
        variant (SGLang's lists after a decode prefix)."""
        from ..planner.contract.state_kinds import rules_of

        return replace(self, state=tuple(replace(c, from_prefix=rules_of(c.kind).starts_at_prefix) for c in self.state))

    def with_tp(self, src_tp: int, dst_tp: int) -> "ModelShape":
        """The same model on other attention TP sizes: per-rank KV and SWA bytes follow the heads a
        destination rank holds (MLA's and the other kinds' items are replicated and stay)."""
        if not self.attention.slices_heads:
            return replace(self, src_tp=src_tp, dst_tp=dst_tp)
        old, new = max(1, self.num_kv_heads // self.dst_tp), max(1, self.num_kv_heads // dst_tp)
        state = tuple(replace(c, item_len=c.item_len // old * new) if c.kind is StateKind.SWA else c
                      for c in self.state)
        return replace(self, token_bytes=self.token_bytes // old * new, state=state, src_tp=src_tp, dst_tp=dst_tp)


# Qwen3-Next's 36 GDN layers, two tensors each: conv_state [conv_dim / tp, kernel - 1] in bf16, its
# 8192 channels query | key | value (16 key heads x 128 twice, 32 value heads x 128), and
# temporal_state [32 heads / tp, ...]. A real temporal head is 128 x 128 fp32 (64 KiB); the preset
# keeps 2 KiB per head so that a demo's pools fit a CI machine (planning work does not depend on it).
QWEN3NEXT_GDN = (ShardedTensor(8192, 3 * 2, groups=(2048, 2048, 4096)), ShardedTensor(32, 2048))

PRESETS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama70b-tp8-p64", Attention.MHA, 80, 256, 64, num_kv_heads=8, src_tp=8, dst_tp=8),
        ModelShape("llama70b-tp8-p1", Attention.MHA, 80, 256, 1, num_kv_heads=8, src_tp=8, dst_tp=8, mean_run=8),
        ModelShape("llama70b-tp4to8-p64", Attention.MHA, 80, 256, 64, num_kv_heads=8, src_tp=4, dst_tp=8),
        ModelShape(
            "dsv32-mla-dsa-p64", Attention.MLA, 61, 1152, 64, mean_run=2,
            state=(ComponentShape(StateKind.DSA, 61, 8448),),
        ),
        ModelShape(
            "gptoss-swa-p16", Attention.MHA, 18, 8 * 64 * 2, 16, num_kv_heads=8,
            state=(ComponentShape(StateKind.SWA, 36, 16 * 8 * 64 * 2, window=128, parts=2),),
        ),
        ModelShape(
            "qwen3next-mamba-p64", Attention.MHA, 12, 2 * 256 * 2, 64, num_kv_heads=2,
            state=(ComponentShape(StateKind.MAMBA, 72, 0, tensors=QWEN3NEXT_GDN),),
        ),
    )
}
# gpt-oss with its SWA state head-sliced from TP 4 to TP 8, Qwen3-Next with its Mamba state sliced
# (docs/tp_state.md)
PRESETS["gptoss-swa-tp4to8-p16"] = replace(PRESETS["gptoss-swa-p16"].with_tp(4, 8), name="gptoss-swa-tp4to8-p16")
PRESETS["qwen3next-mamba-tp4to8-p64"] = replace(PRESETS["qwen3next-mamba-p64"].with_tp(4, 8),
                                                name="qwen3next-mamba-tp4to8-p64")




@dataclass(frozen=True)
class Scenario:
    """One scenario of docs/benchmarks.md: a model shape (:data:`PRESETS`), a batch, and for the decode
    side another page size where it has one. ``kvplan bench`` plans it at full size; ``kvplan demo
    --preset NAME`` moves it at small scale."""

    name: str
    preset: str
    requests: int
    prompt_len: int
    shape: str  # the table's words for its shape (per rank)
    mode: str  # ... and for how it is planned
    dst_page_size: int | None = None


# the one list of scenarios: the bench's, the demo's presets, and docs/benchmarks.md's table (a test renders it)
SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("llama70b-tp8-p64", "llama70b-tp8-p64", 32, 8192,
             "MHA, 80 layers = 160 entries, 1 KV head x 128, bf16: item 16 KiB", "direct"),
    Scenario("llama70b-tp8-p1", "llama70b-tp8-p1", 8, 8192, "same shape, item 256 B",
             "direct (descriptor explosion)"),
    Scenario("llama70b-tp4to8-p64", "llama70b-tp4to8-p64", 8, 8192,
             "source 2 KV heads/rank (TP4), destination 1 (TP8)", "head-sliced, and staged"),
    Scenario("dsv32-mla-dsa-p64", "dsv32-mla-dsa-p64", 64, 4096,
             "MLA, 61 layers, 1152 B/token (item 72 KiB) + `DSA` component: 61 entries of 8448 B per page", "direct"),
    Scenario("gptoss-swa-p16", "gptoss-swa-p16", 32, 16384,
             "18 full-attention layers (36 entries) + `SWA` component of 18 layers (36 entries), 8 KV heads x 64, "
             "bf16: item 16 KiB; window 128", "direct"),
    Scenario("qwen3next-mamba-p64", "qwen3next-mamba-p64", 64, 4096,
             "12 full-attention layers (24 entries, 2 KV heads x 256, bf16: item 64 KiB) + `MAMBA` component: 36 "
             "layers x (conv, temporal) = 72 entries", "direct"),
    Scenario("llama70b-tp8-p64-to-p16", "llama70b-tp8-p64", 32, 8192,
             "`llama70b-tp8-p64` with a decode side of page size 16 (docs/page_sizes.md): KV in units of 16 "
             "tokens, chunks on 64", "direct; `numpy-batch` plans the same mapping, and neither `prepared-ids` nor "
             "`sglang-loop` exists for it (SGLang refuses the pairing)", dst_page_size=16),
    Scenario("gptoss-swa-tp4to8-p16", "gptoss-swa-tp4to8-p16", 32, 16384,
             "`gptoss-swa-p16` from TP 4 to TP 8 (docs/tp_state.md): KV and the SWA state head-sliced, one "
             "descriptor per entry, page and token", "head-sliced; `numpy-batch` and `sglang-loop` (SGLang's "
             "`_send_swa_state_slice`) plan the same, `prepared-ids` does not exist for it"),
    Scenario("qwen3next-mamba-tp4to8-p64", "qwen3next-mamba-tp4to8-p64", 64, 4096,
             "`qwen3next-mamba-p64` from TP 4 to TP 8 (docs/tp_state.md): KV head-sliced, the Mamba state sliced "
             "along each tensor's TP dimension (GDN's query, key and value groups each)",
             "head-sliced; `numpy-batch` and `sglang-loop` plan the same, `prepared-ids` does not exist for it"),
)}


def scenarios_table() -> str:
    """docs/benchmarks.md's table of :data:`SCENARIOS`, in Markdown."""
    rows = ["| name | shape (per rank) | ps | batch (requests x tokens) | mode |", "|---|---|---|---|---|"]
    for s in SCENARIOS.values():
        ps = PRESETS[s.preset].page_size
        pages = f"{ps} -> {s.dst_page_size}" if s.dst_page_size else f"{ps}"
        rows.append(f"| `{s.name}` | {s.shape} | {pages} | {s.requests} x {s.prompt_len} | {s.mode} |")
    return "\n".join(rows) + "\n"


def paired_ranks(src_tp: int, dst_tp: int) -> tuple[int, int]:
    """A source rank and the destination rank it serves (TP-sliced state pairs ranks that share a
    shard: docs/tp_state.md §4): destination rank 2 when scattering, source rank 1 when gathering."""
    if src_tp <= dst_tp:
        dst_rank = 2 % dst_tp
        return partner_rank(dst_rank, dst_tp, src_tp), dst_rank
    src_rank = 1 % src_tp
    return src_rank, partner_rank(src_rank, src_tp, dst_tp)


def fragmented_free_list(rng: np.random.Generator, num_pages: int, mean_run: float) -> np.ndarray:
    """Pages ``1..num_pages-1`` as runs of geometric length (mean ``mean_run``), runs shuffled."""
    pages = np.arange(1, num_pages, dtype=np.int64)
    lengths = rng.geometric(1.0 / mean_run, size=len(pages))
    cuts = np.cumsum(lengths)
    cuts = cuts[cuts < len(pages)]
    runs = np.split(pages, cuts)
    order = rng.permutation(len(runs))
    return np.concatenate([runs[i] for i in order]) if runs else pages


def _fake_entries(rng: np.random.Generator, count: int, item_len: int, num_items: int) -> tuple[Entry, ...]:
    """Entries at made-up, non-overlapping, page-aligned addresses (for planning without memory)."""
    return _fake_entries_of(rng, [item_len] * count, num_items)


def _fake_entries_of(rng: np.random.Generator, item_lens: list[int], num_items: int) -> tuple[Entry, ...]:
    """Like :func:`_fake_entries`, one item length per entry (spaced by the largest)."""
    base = int(rng.integers(1, 1 << 20)) << 24
    stride = -(-(max(item_lens, default=0) * num_items) // 4096) * 4096 + 4096
    return tuple(Entry(base + i * stride, item, num_items) for i, item in enumerate(item_lens))


def _side(
    shape: ModelShape, rng: np.random.Generator, rows: int, prompt_lens: list[int], tp: int, tp_rank: int, heads: int
) -> tuple[SideMemory, np.ndarray]:
    ps = shape.page_size
    need = sum(cdiv(n, ps) for n in prompt_lens)
    num_pages = need + need // 4 + 2
    free = fragmented_free_list(rng, num_pages, shape.mean_run)
    max_ctx = max(prompt_lens) + ps
    table = np.zeros((rows, max_ctx), dtype=np.int32)
    cursor = 0
    for r, length in enumerate(prompt_lens, start=1):
        n = cdiv(length, ps)
        pages = free[cursor : cursor + n]
        cursor += n
        slots = (pages[:, None] * ps + np.arange(ps)[None, :]).reshape(-1)[:length]
        table[r, :length] = slots
    if shape.attention.slices_heads:  # token_bytes is the destination rank's; heads split by TP
        head_bytes = shape.token_bytes // max(1, heads // shape.dst_tp)
        kv_item = head_bytes * max(1, heads // tp) * ps
    else:
        kv_item = shape.token_bytes * ps
    entries_per_layer = shape.attention.parts
    kv = KVLayout(
        shape.attention, ps, _fake_entries(rng, entries_per_layer * shape.layers, kv_item, num_pages),
        num_kv_heads=heads, tp_size=tp, tp_rank=tp_rank,
    )
    comps = []
    num_slots = num_pages * ps
    for c in shape.state:
        layers = c.layers(shape.layers)
        if c.kind is StateKind.SWA:
            swa_item = c.item_len
            if shape.attention.slices_heads:  # the destination rank's, heads split by TP as KV's
                swa_item = c.item_len // max(1, heads // shape.dst_tp) * max(1, heads // tp)
            swa_pages = fragmented_free_list(rng, num_pages, shape.mean_run)
            slot_map = np.zeros(num_slots, dtype=np.int64)
            used = 0
            for r, length in enumerate(prompt_lens, start=1):
                ws = (max(0, length - c.window) // ps) * ps
                for k in range(ws // ps, cdiv(length, ps)):
                    full_page = table[r, k * ps] // ps
                    slot_map[full_page * ps : full_page * ps + ps] = swa_pages[used] * ps + np.arange(ps)
                    used += 1
            comps.append(StateComponent(c.kind, _fake_entries(rng, c.entries, swa_item, num_pages), window=c.window,
                                        slot_map=slot_map, layers=layers, name=c.name, from_prefix=c.from_prefix))
        elif c.kind is StateKind.DSA:
            comps.append(StateComponent(c.kind, _fake_entries(rng, c.entries, c.item_len, num_pages), layers=layers,
                                        name=c.name, from_prefix=c.from_prefix))
        elif c.kind is StateKind.SWA_RING:
            comps.append(StateComponent(c.kind, _fake_entries(rng, c.entries, c.item_len, rows * c.ring_size),
                                        window=c.window, ring_size=c.ring_size, layers=layers, name=c.name))
        elif c.tensors:  # per entry its tensor's item on this side's TP size, and its shard
            slots = rng.permutation(rows * 2)[:rows].astype(np.int64)
            items, shards = zip(*(c.tensors[i % len(c.tensors)].on(tp) for i in range(c.entries)))
            comps.append(StateComponent(c.kind, _fake_entries_of(rng, list(items), rows * 2), slot_map=slots,
                                        shards=shards, layers=layers, name=c.name))
        else:
            slots = rng.permutation(rows * 2)[:rows].astype(np.int64)
            comps.append(StateComponent(c.kind, _fake_entries(rng, c.entries, c.item_len, rows * 2), slot_map=slots,
                                        layers=layers, name=c.name))
    aux = tuple(e for size in shape.aux_items for e in _fake_entries(rng, 1, size, rows * 2))
    return SideMemory(kv, tuple(comps), aux, table), table


def build_batch(
    shape: ModelShape,
    requests: int,
    prompt_len: int | list[int],
    chunks: int = 1,
    prefix_len: int = 0,
    seed: int = 0,
    src_rank: int = 0,
    dst_rank: int = 0,
    policy: Policy = Policy.STRICT,
    dst_page_size: int | None = None,
) -> Batch:
    """A batch of ``requests`` requests, each split into ``chunks`` chunks, all to one destination.

    Each request's last chunk has ``fill_len = prompt_len + 1`` (the sampled token, never sent).
    ``dst_page_size``: the destination's KV page size when it differs from the model's
    (docs/page_sizes.md); chunks then end on the least common multiple of the two.
    """
    rng = np.random.default_rng(seed)
    lens = [prompt_len] * requests if isinstance(prompt_len, int) else list(prompt_len)
    rows = len(lens) + 1
    ps = shape.page_size
    dst_shape = shape.scaled(page_size=dst_page_size) if dst_page_size else shape
    ps = ps * dst_shape.page_size // gcd(ps, dst_shape.page_size)  # the chunk grain
    src, _ = _side(shape, rng, rows, lens, shape.src_tp, src_rank, shape.num_kv_heads)
    dst, _ = _side(dst_shape, rng, rows, lens, shape.dst_tp, dst_rank, shape.num_kv_heads)
    src_aux = rng.permutation(rows * 2)[:rows]
    dst_aux = rng.permutation(rows * 2)[:rows]
    transfers = []
    for r, length in enumerate(lens, start=1):
        p = min(prefix_len, (length - 1) // ps * ps) if length else 0
        dl = destination_lists(dst, r, p, length, request=f"req{r}")
        bounds = np.linspace(p, length, chunks + 1)
        start = p
        for k in range(chunks):
            last = k == chunks - 1
            fill = length + 1 if last else int(bounds[k + 1])
            t = Transfer(
                request=f"req{r}", src_row=r, start=start, fill_len=fill, prompt_len=length, last=last,
                dst_pages=dl.pages, prefix_len=p, aux_src=int(src_aux[r]), aux_dst=int(dst_aux[r]),
                dst_state=dl.state,
            )
            transfers.append(t)
            start = max(start, (min(fill, length) // ps) * ps) if not last else start
    return Batch(src=src, dsts=(dst,), transfers=tuple(transfers), policy=policy)


def materialize(side: SideMemory, device: torch.device | str = "cpu", seed: int | None = None
                ) -> tuple[SideMemory, list[torch.Tensor]]:
    """The same side backed by real memory: one uint8 tensor per entry (random bytes from ``seed``,
    zeros when ``seed`` is None). Returns the side with real base pointers and the tensors (keep them
    alive as long as the addresses are used)."""
    import torch

    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    tensors: list[torch.Tensor] = []

    def real(entries: tuple[Entry, ...]) -> tuple[Entry, ...]:
        out = []
        for e in entries:
            size = e.item_len * e.num_items
            if gen is None:
                t = torch.zeros(size, dtype=torch.uint8, device=device)
            else:
                t = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).to(device)
            tensors.append(t)
            out.append(Entry(t.data_ptr(), e.item_len, e.num_items))
        return tuple(out)

    kv = replace(side.kv, entries=real(side.kv.entries))
    state = tuple(replace(c, entries=real(c.entries)) for c in side.state)
    return SideMemory(kv, state, real(side.aux), side.req_to_token), tensors
