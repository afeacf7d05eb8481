"""kvplan's plan against what SGLang 0.5.23's own Mooncake and NIXL KV managers would post, for
the same ``KVArgs`` and indices, as sets of byte ranges.

SGLang's ``MooncakeKVManager`` and ``NixlKVManager`` are built without their constructors (no
engine, no threads, no sockets), with the attributes their planning methods read. Their engines are
recorders: Mooncake's ``batch_transfer_sync``, and NIXL's ``get_xfer_descs``, ``prep_xfer_dlist``,
``initialize_xfer`` and ``make_prepped_xfer`` (a prepared transfer is recorded as the descriptors
its indices select from the two prepared lists). Their memory configuration is a namespace with
``enable_unified_memory=False`` and ``enable_kv_cache_sharding=False`` (the defaults). Everything
else they run is their own planning code: Mooncake's ``send_kvcache`` (runs per layer),
``send_kvcache_slice`` (one block per token and head slice), ``send_aux`` and
``maybe_send_extra``; NIXL's prepared lists for equal and different TP sizes
(``_init_equal_tp_prep_handle``, ``_init_hetero_tp_prep_handle``), ``send_kvcache``,
``send_kvcache_slice``, ``send_aux`` and ``maybe_send_extra``. The indices are the ones SGLang's
scheduler hands them: the chunk's page ids by SGLang's own ``kv_to_page_indices`` over
``req_to_token``, the decode's pages sliced at the chunk's first page.
"""

from __future__ import annotations

import concurrent.futures
import types
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.integrations.sglang import side_from_kv_args
from tests.integrations.sglang_polls import poll_until_concluded
from kvplan.planner.contract.batch import Batch, Transfer
from kvplan.planner.reference.oracle import plan_reference
from tests.sglang_real import sglang_module
from tests.transport.fakes import FakeChannel, FakeEngine

pytestmark = pytest.mark.sglang


class Recorder:
    """SGLang's Mooncake transfer engine, replaced: it records every block and moves nothing."""

    def __init__(self):
        self.blocks: list[tuple[int, int, int]] = []

    def batch_transfer_sync(self, session_id, src_addrs, dst_addrs, lengths) -> int:
        self.blocks += [(int(s), int(d), int(n)) for s, d, n in zip(src_addrs, dst_addrs, lengths)]
        return 0


class NixlRecorder:
    """SGLang's NIXL agent, replaced: descriptor lists are kept as arrays, transfers are recorded
    as the blocks they pair, nothing moves. Strided (Nx5) lists are refused with ``TypeError``, as an
    older NIXL does, so SGLang expands them itself."""

    def __init__(self):
        self.blocks: list[tuple[int, int, int]] = []
        self.lists: list[np.ndarray] = []

    def get_xfer_descs(self, descs, mem_kind):
        return np.asarray(descs, dtype=np.uint64).reshape(-1, 3)

    def prep_xfer_dlist(self, agent_name, descs, mem_kind):
        descs = np.asarray(descs, dtype=np.uint64)
        if descs.ndim == 2 and descs.shape[1] == 5:
            raise TypeError("strided descriptors are not supported by this recorder")
        self.lists.append(descs.reshape(-1, 3))
        return len(self.lists) - 1

    def _pair(self, src, dst):
        assert len(src) == len(dst) and np.array_equal(src[:, 1], dst[:, 1]), "SGLang paired unequal descriptors"
        self.blocks += [(int(s), int(d), int(n)) for s, d, n in zip(src[:, 0], dst[:, 0], src[:, 1])]
        return len(self.blocks) or 1

    def initialize_xfer(self, op, src_descs, dst_descs, peer_name, *args):
        return self._pair(src_descs, dst_descs)

    def make_prepped_xfer(self, op, src_handle, src_indices, dst_handle, dst_indices, *args):
        src_idx, dst_idx = np.asarray(src_indices, np.int64), np.asarray(dst_indices, np.int64)
        return self._pair(self.lists[src_handle][src_idx], self.lists[dst_handle][dst_idx])

    def transfer(self, handle, *args):
        return "PROC"


@pytest.fixture(scope="module")
def sglang():
    return types.SimpleNamespace(conn=sglang_module("srt.disaggregation.mooncake.conn"),
                                 nixl=sglang_module("srt.disaggregation.nixl.conn"),
                                 base=sglang_module("srt.disaggregation.base.conn"),
                                 pages=sglang_module("srt.mem_cache.common"))


def byte_ranges(blocks) -> list[tuple[int, int, int]]:
    """Blocks as a canonical set of byte ranges: sorted by source, touching ranges merged where both
    sides continue, so two plans that cut the same bytes differently compare equal."""
    out: list[list[int]] = []
    for s, d, n in sorted((int(s), int(d), int(n)) for s, d, n in blocks if n):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += n
        else:
            out.append([s, d, n])
    return [tuple(r) for r in out]


def kv_args(sglang, *, base: int, layers: int, mla: bool, page_size: int, num_pages: int, token_bytes: int,
            heads: int, tp_size: int, rank: int, aux_items: tuple[int, ...]):
    """One side's ``KVArgs`` as SGLang fills it: addresses only, nothing is allocated."""
    args = sglang.base.KVArgs()
    entries = layers if mla else 2 * layers
    item = page_size * token_bytes
    args.kv_data_ptrs = [base + e * (1 << 32) for e in range(entries)]
    args.kv_data_lens = [item * num_pages] * entries
    args.kv_item_lens = [item] * entries
    args.kv_layer_ids = None
    args.prefill_start_layer, args.prefill_end_layer, args.mla_compression_ratios = 0, None, None
    args.page_size, args.engine_rank = page_size, rank
    args.kv_head_num, args.total_kv_head_num = max(1, heads // tp_size), heads
    args.aux_data_ptrs = [base + (1 << 40) + i * (1 << 32) for i in range(len(aux_items))]
    args.aux_data_lens = [n * 64 for n in aux_items]
    args.aux_item_lens = list(aux_items)
    args.gpu_id, args.state_types, args.state_data_ptrs, args.state_item_lens = 0, [], [], []
    args.state_layer_ids = args.state_dim_per_tensor = []
    return args


class MooncakeDriver:
    """SGLang's ``MooncakeKVManager`` on the prefill side, its engine a :class:`Recorder`."""

    def __init__(self, sglang, src_args, dst_args, *, mla: bool, src_tp: int, dst_tp: int, monkeypatch):
        conn = sglang.conn
        monkeypatch.setattr(conn, "get_memory", lambda: types.SimpleNamespace(enable_unified_memory=False))
        monkeypatch.setattr(conn, "get_parallel", lambda: types.SimpleNamespace(enable_kv_cache_sharding=False))
        mgr = self.mgr = object.__new__(conn.MooncakeKVManager)
        mgr.kv_args, mgr.is_mla_backend, mgr.is_hybrid_mla_backend = src_args, mla, False
        mgr.pp_size, mgr.attn_tp_size, mgr.state_tp_size = 1, src_tp, src_tp
        mgr.enable_custom_mem_pool, mgr.custom_mem_pool_type = False, None
        mgr.max_transfer_batch_indices, mgr.state_strides_validated = 0, set()
        mgr.request_status = {0: sglang.base.KVPoll.Transferring}
        mgr.engine = Recorder()
        self.dst, self.dst_tp, self.head_sliced = dst_args, dst_tp, src_tp != dst_tp and not mla
        self.executor = concurrent.futures.ThreadPoolExecutor(2)

    @property
    def blocks(self):
        return self.mgr.engine.blocks

    def kv(self, src_pages, dst_pages):
        if self.head_sliced:
            ret = self.mgr.send_kvcache_slice("peer", src_pages, self.dst.kv_data_ptrs, dst_pages,
                                              self.dst.engine_rank, self.dst_tp, self.dst.kv_item_lens[0],
                                              self.executor)
        else:
            ret = self.mgr.send_kvcache("peer", src_pages, self.dst.kv_data_ptrs, dst_pages, self.executor)
        assert ret == 0

    def aux(self, src_row, dst_row):
        info = types.SimpleNamespace(mooncake_session_id="peer", dst_aux_index=dst_row)
        assert self.mgr.send_aux(info, src_row, self.dst.aux_data_ptrs) == 0

    def state(self, src_lists, dst_lists):
        req = types.SimpleNamespace(mooncake_session_id="peer", room=0, dst_state_indices=dst_lists)
        target = types.SimpleNamespace(
            dst_state_data_ptrs=self.dst.state_data_ptrs, dst_state_item_lens=self.dst.state_item_lens,
            dst_state_dim_per_tensor=self.dst.state_dim_per_tensor, dst_state_layer_ids=self.dst.state_layer_ids,
            dst_attn_tp_size=self.dst_tp, dst_tp_rank=self.dst.engine_rank)
        assert self.mgr.maybe_send_extra(req, src_lists, self.executor, target) == 0


class NixlDriver:
    """SGLang's ``NixlKVManager`` on the prefill side, its agent a :class:`NixlRecorder`; the
    prepared lists are made by SGLang's ``_prepare_payload_xfer`` from the decode's registration."""

    def __init__(self, sglang, src_args, dst_args, *, mla: bool, src_tp: int, dst_tp: int, monkeypatch):
        conn = sglang.nixl
        monkeypatch.setattr(conn, "get_memory", lambda: types.SimpleNamespace(enable_unified_memory=False),
                            raising=False)
        mgr = self.mgr = object.__new__(conn.NixlKVManager)
        mgr.kv_args, mgr.is_mla_backend, mgr.is_hybrid_mla_backend = src_args, mla, False
        mgr.pp_size, mgr.attn_tp_size, mgr.state_tp_size = 1, src_tp, src_tp
        mgr.agent, mgr.src_mem_kind, mgr._use_strided_descs = NixlRecorder(), "VRAM", True
        mgr.prep_handles, mgr.prep_handle_slice_src, mgr.prep_handles_slice_dst = {}, None, {}
        mgr._num_slots_src = src_args.kv_data_lens[0] // src_args.kv_item_lens[0]
        mgr._state_layout_rejections, mgr._prepared_state_plans = {}, {}
        self.info = conn.KVArgsRegisterInfo(
            room="0", endpoint="127.0.0.1", dst_port=0, agent_name="peer", agent_metadata=b"",
            dst_kv_ptrs=list(dst_args.kv_data_ptrs), dst_kv_mem_kinds=["VRAM"] * len(dst_args.kv_data_ptrs),
            dst_aux_ptrs=list(dst_args.aux_data_ptrs), dst_state_data_ptrs=dst_args.state_data_ptrs, gpu_id=0,
            decode_tp_size=dst_tp, decode_tp_rank=dst_args.engine_rank, dst_kv_item_len=dst_args.kv_item_lens[0],
            dst_kv_item_lens=list(dst_args.kv_item_lens),
            dst_num_slots=dst_args.kv_data_lens[0] // dst_args.kv_item_lens[0],
            dst_state_item_lens=dst_args.state_item_lens, dst_state_layer_ids=dst_args.state_layer_ids)
        mgr.decode_kv_args_table = {"peer": self.info}
        mgr._prepare_payload_xfer(self.info)
        self.dst, self.dst_tp, self.head_sliced = dst_args, dst_tp, src_tp != dst_tp and not mla

    @property
    def blocks(self):
        return self.mgr.agent.blocks

    def kv(self, src_pages, dst_pages):
        if self.head_sliced:
            assert self.mgr.send_kvcache_slice("peer", src_pages, dst_pages)
        else:
            assert self.mgr.send_kvcache("peer", src_pages, self.dst.kv_data_ptrs, dst_pages, 0)

    def aux(self, src_row, dst_row):
        assert self.mgr.send_aux("peer", src_row, self.dst.aux_data_ptrs, dst_row)

    def state(self, src_lists, dst_lists):
        handles = self.mgr.maybe_send_extra("peer", src_lists, self.dst.state_data_ptrs, dst_lists, 0, self.dst_tp,
                                            self.dst.engine_rank, dst_state_item_lens=self.dst.state_item_lens,
                                            dst_state_dim_per_tensor=self.dst.state_dim_per_tensor,
                                            dst_state_layer_ids=self.dst.state_layer_ids)
        list(handles)  # a generator: each state handle is yielded to the chunk's owner


DRIVERS = {"mooncake": MooncakeDriver, "nixl": NixlDriver}


def drive(sglang, driver, batch) -> list[tuple[int, int, int]]:
    """Every block SGLang posts for the batch's transfers, chunk by chunk as its scheduler sends them."""
    table = torch.from_numpy(np.asarray(batch.src.req_to_token))
    ps = batch.src.kv.page_size
    for t in batch.transfers:
        end = t.prompt_len if t.last else t.fill_len // ps * ps
        src_pages = sglang.pages.kv_to_page_indices(table[t.src_row, t.start:end], ps).astype(np.int32)
        first = (t.start - t.prefix_len) // ps
        driver.kv(src_pages, np.asarray(t.dst_pages, np.int32)[first : first + len(src_pages)])
        if t.last:
            driver.aux(t.aux_src, t.aux_dst)
    return driver.blocks


def random_batch(rng, src, dst, requests: int, prefix_pages: int, chunked: bool) -> Batch:
    """Requests of random lengths on shuffled pages of both sides, a decode prefix, maybe two chunks."""
    ps = src.kv.page_size
    lengths = [int(n) for n in rng.integers(prefix_pages * ps + 1, prefix_pages * ps + 6 * ps, requests)]
    width = max(-(-n // ps) * ps for n in lengths)
    table = np.zeros((requests + 1, width), np.int32)
    src_free = iter(rng.permutation(np.arange(1, src.kv.num_pages)))
    dst_free = iter(rng.permutation(np.arange(1, dst.kv.num_pages)))
    transfers = []
    for r, length in enumerate(lengths, start=1):
        pages = np.array([next(src_free) for _ in range(-(-length // ps))])
        table[r, :length] = (pages[:, None] * ps + np.arange(ps)).reshape(-1)[:length]
        prefix = prefix_pages * ps
        dst_pages = np.array([next(dst_free) for _ in range(-(-(length - prefix) // ps))], np.int64)
        cut = prefix + (length - prefix) // 2 // ps * ps if chunked else prefix
        common = dict(prefix_len=prefix, aux_src=r, aux_dst=requests + 1 - r)
        if cut > prefix:
            transfers.append(Transfer(f"r{r}", r, prefix, cut, length, False, dst_pages, **common))
        transfers.append(Transfer(f"r{r}", r, cut, length, length, True, dst_pages, **common))
    return Batch(src.__class__(src.kv, src.state, src.aux, table), (dst,), tuple(transfers))


# (mla, heads, src_tp, src_rank, dst_tp, dst_rank): direct MHA and MLA; head-sliced TP 2 -> 4,
# 4 -> 2, and 2 -> 8 with fewer KV heads than ranks (replicated heads)
LAYOUTS = [(False, 4, 1, 0, 1, 0), (True, 1, 1, 0, 1, 0), (False, 4, 2, 1, 4, 3), (False, 4, 4, 2, 2, 1),
           (False, 2, 2, 1, 8, 6)]


def layout_sides(sglang, layers: int, page_size: int, mla: bool, heads: int, src_tp: int, src_rank: int, dst_tp: int,
                 dst_rank: int):
    """Both sides of a layout of ``LAYOUTS``: SGLang's ``KVArgs`` and kvplan's sides made from them."""
    bph = 8  # bytes per head and token
    shape = dict(layers=layers, mla=mla, page_size=page_size, num_pages=64, heads=heads, aux_items=(16, 48))
    src_args = kv_args(sglang, base=1 << 48, token_bytes=bph * (1 if mla else max(1, heads // src_tp)),
                       tp_size=src_tp, rank=src_rank, **shape)
    dst_args = kv_args(sglang, base=2 << 48, token_bytes=bph * (1 if mla else max(1, heads // dst_tp)),
                       tp_size=dst_tp, rank=dst_rank, **shape)
    return (src_args, dst_args, side_from_kv_args(src_args, mla=mla, attn_tp_size=src_tp),
            side_from_kv_args(dst_args, mla=mla, attn_tp_size=dst_tp))


@pytest.mark.parametrize("engine", sorted(DRIVERS))
@pytest.mark.parametrize("mla, heads, src_tp, src_rank, dst_tp, dst_rank", LAYOUTS)
def test_kv_and_aux_byte_ranges_equal_sglang_s(sglang, monkeypatch, engine, mla, heads, src_tp, src_rank, dst_tp,
                                               dst_rank):
    @settings(max_examples=10, deadline=None)
    @given(page_size=st.sampled_from([1, 4, 16]), layers=st.integers(1, 3), requests=st.integers(1, 4),
           prefix_pages=st.integers(0, 2), chunked=st.booleans(), seed=st.integers(0, 2**31))
    def check(page_size, layers, requests, prefix_pages, chunked, seed):
        src_args, dst_args, src, dst = layout_sides(sglang, layers, page_size, mla, heads, src_tp, src_rank, dst_tp,
                                                    dst_rank)
        batch = random_batch(np.random.default_rng(seed), src, dst, requests, prefix_pages, chunked)
        ours = plan_reference(batch).descriptors()[0]
        driver = DRIVERS[engine](sglang, src_args, dst_args, mla=mla, src_tp=src_tp, dst_tp=dst_tp,
                                 monkeypatch=monkeypatch)
        theirs = drive(sglang, driver, batch)
        assert byte_ranges(ours) == byte_ranges(theirs)
        assert len(ours) <= len(theirs)  # kvplan never cuts finer than SGLang

    check()


# -- state components and aux: SGLang's maybe_send_extra -------------------------------------------

def kv_args_of(sglang, side, rank: int = 0):
    """The ``KVArgs`` SGLang registers for the memory a kvplan side describes (state included)."""
    args = sglang.base.KVArgs()
    kv = side.kv
    args.kv_data_ptrs = [e.base_ptr for e in kv.entries]
    args.kv_data_lens = [e.item_len * e.num_items for e in kv.entries]
    args.kv_item_lens = [e.item_len for e in kv.entries]
    args.kv_layer_ids = None
    args.prefill_start_layer, args.prefill_end_layer, args.mla_compression_ratios = kv.first_layer, None, None
    args.page_size, args.engine_rank = kv.page_size, rank
    args.kv_head_num, args.total_kv_head_num = max(1, kv.num_kv_heads // kv.tp_size), kv.num_kv_heads
    args.aux_data_ptrs = [e.base_ptr for e in side.aux]
    args.aux_data_lens = [e.item_len * e.num_items for e in side.aux]
    args.aux_item_lens = [e.item_len for e in side.aux]
    args.state_types = [sglang.base.StateType(c.kind.value) for c in side.state]
    args.state_data_ptrs = [[e.base_ptr for e in c.entries] for c in side.state]
    args.state_data_lens = [[e.item_len * e.num_items for e in c.entries] for c in side.state]
    args.state_item_lens = [[e.item_len for e in c.entries] for c in side.state]
    args.state_layer_ids = [[] for _ in side.state]
    # Mamba's shards (docs/tp_state.md §4) as SGLang registers them: per entry the sharded dimension
    # on this rank, the outer rows and the GDN groups (None when the entry has none)
    args.state_dim_per_tensor = [[s.dim for s in c.shards] for c in side.state]
    args.state_slice_outer_counts = [[s.outer for s in c.shards] for c in side.state]
    args.state_conv_shard_groups = [[list(s.groups) or None for s in c.shards] for c in side.state]
    args.gpu_id, args.swa_kv_cache_layout = 0, "nhd"  # kvplan's pages are token-major (NHD)
    return args


def state_params_of(side) -> list[dict]:
    """What SGLang's ``KVArgs`` does not hold of each component (``side_from_kv_args``'s ``state_params``)."""
    return [{"window": c.window, "ring_size": c.ring_size, "page_size": c.page_size, "slot_map": c.slot_map,
             "name": c.name, "from_prefix": c.from_prefix} for c in side.state]


def same_components(a, b) -> bool:
    fields = ("kind", "entries", "window", "page_size", "ring_size", "name", "shards", "from_prefix")
    return len(a) == len(b) and all(getattr(x, f) == getattr(y, f) for x, y in zip(a, b) for f in fields) and all(
        (x.slot_map is None) == (y.slot_map is None) and (x.slot_map is None or np.array_equal(x.slot_map, y.slot_map))
        for x, y in zip(a, b))


# SGLang's NIXL path refuses the replicated Mamba item of mamba_tp4to8 between TP sizes (named in
# test_mamba_state_sliced_between_tp_sizes_equals_sglang_s)
@pytest.mark.parametrize("engine, shape", [(e, s) for e in sorted(DRIVERS)
                                           for s in ("ring_mamba", "swa16", "dsa16", "swa_tp4to8", "mamba_tp4to8")
                                           if (e, s) != ("nixl", "mamba_tp4to8")])
@pytest.mark.parametrize("prefix_len, chunks, variant", [(0, 1, False), (0, 2, False), (32, 2, False), (32, 2, True)])
def test_state_kinds_and_aux_byte_ranges_equal_sglang_s(sglang, monkeypatch, engine, shape, prefix_len, chunks,
                                                         variant):
    """An SWA ring and Mamba state (MHA), SWA state (MHA, gpt-oss-like), DSA indexer pages (MLA,
    as SGLang has them only with MLA), SWA state with KV head-sliced from TP 4 to TP 8
    (SGLang's ``_send_swa_state_slice``; docs/tp_state.md) and Mamba state sliced from TP 4 to TP 8
    with it (``_send_mamba_state_slice``), with aux: the source side is read back from SGLang's
    ``KVArgs`` (state and shards included); the state lists kvplan computes, handed to SGLang's
    ``maybe_send_extra`` with the decode's published lists, give the blocks of kvplan's plan; with
    ``variant``, SWA and DSA lists start at the decode prefix (``from_prefix``), as SGLang's own do."""
    from kvplan.planner.contract.batch import Attention
    from kvplan.tools.scenarios import build_batch
    from tests.transport.handoff import LENGTHS, SHAPES

    model = SHAPES[shape].from_prefix() if variant else SHAPES[shape]
    batch = build_batch(model, requests=len(LENGTHS), prompt_len=list(LENGTHS), chunks=chunks,
                        prefix_len=prefix_len, seed=5)
    plan = plan_reference(batch)
    mla = model.attention is Attention.MLA
    src_args, dst_args = kv_args_of(sglang, batch.src), kv_args_of(sglang, batch.dsts[0])
    mine = side_from_kv_args(src_args, mla=mla, attn_tp_size=model.src_tp, req_to_token=batch.src.req_to_token,
                             state_params=state_params_of(batch.src))
    assert (mine.kv, mine.aux) == (batch.src.kv, batch.src.aux)  # the mapping round-trips
    assert same_components(mine.state, batch.src.state)
    driver = DRIVERS[engine](sglang, src_args, dst_args, mla=mla, src_tp=model.src_tp, dst_tp=model.dst_tp,
                             monkeypatch=monkeypatch)
    drive(sglang, driver, batch)  # KV and aux
    for t, tp in zip(batch.transfers, plan.transfers):
        if t.last:
            driver.state([np.asarray(c.src_list, np.int32) for c in tp.state],
                         [list(map(int, ids)) for ids in t.dst_state])
    assert byte_ranges(plan.descriptors()[0]) == byte_ranges(driver.blocks)


@pytest.mark.parametrize("shape", ["ring_mamba", "swa16", "dsa16"])
@pytest.mark.parametrize("prefix_len, variant", [(0, False), (32, False), (32, True)])
def test_state_lists_are_sglang_s_payloads_and_the_prefix_variants_are_named(sglang, shape, prefix_len, variant):
    """The source's state lists against SGLang 0.5.23's payloads (``PrefillMixin.send_kv_chunk`` in
    ``disaggregation/prefill.py``: ``_swa_payload``, ``_dsa_pages_payload``, ``_swa_ring_payload``,
    ``_mamba_payload``). Those are closures over a live scheduler, so their formulas are restated
    here around SGLang's own ``kv_to_page_indices`` and ``suffix_page_indices``.

    Named differences (docs/planning.md §6, "optional later variants"): with a decode prefix
    ``P > 0``, 0.5.23 starts the SWA window at ``max(P, seq - W)`` and sends DSA pages of
    ``[P, seq)``; kvplan starts at ``max(0, seq - W)`` and sends DSA pages of ``[0, seq)``, so its
    lists are SGLang's with the prefix's pages in front (the decode side publishes the same, so
    they pair). With ``P = 0`` they are equal. In the ``from_prefix`` variant (``variant``, what the
    adapter declares) they are equal for every ``P``."""
    from kvplan.planner.contract.batch import StateKind
    from kvplan.tools.scenarios import build_batch
    from tests.transport.handoff import LENGTHS, SHAPES

    model = SHAPES[shape].from_prefix() if variant else SHAPES[shape]
    batch = build_batch(model, requests=len(LENGTHS), prompt_len=list(LENGTHS), chunks=2,
                        prefix_len=prefix_len, seed=7)
    plan = plan_reference(batch)
    table = torch.from_numpy(np.asarray(batch.src.req_to_token).astype(np.int64))
    ps = batch.src.kv.page_size
    checked = 0
    for t, tp in zip(batch.transfers, plan.transfers):
        if not t.last:
            continue
        seq, p = t.prompt_len, t.prefix_len
        for comp, lists in zip(batch.src.state, tp.state):
            ours = np.asarray(lists.src_list).tolist()
            if comp.kind is StateKind.DSA:
                theirs = sglang.pages.suffix_page_indices(table, t.src_row, p, seq, ps).tolist()
                prefix_pages = sglang.pages.kv_to_page_indices(table[t.src_row, :p], ps).tolist()
                assert ours == (theirs if comp.from_prefix else prefix_pages + theirs)
            elif comp.kind is StateKind.SWA:
                full_to_swa = torch.from_numpy(np.asarray(comp.slot_map))
                start = max(p, seq - comp.window) // ps * ps  # 0.5.23: max(decode_prefix_len, seq - W)
                theirs = sglang.pages.kv_to_page_indices(full_to_swa[table[t.src_row, start:seq]], ps).tolist()
                start0 = max(0, seq - comp.window) // ps * ps  # kvplan, and 0.5.23 whenever P <= that
                extra = sglang.pages.kv_to_page_indices(full_to_swa[table[t.src_row, start0:start]], ps).tolist() \
                    if start > start0 and not comp.from_prefix else []
                assert ours == extra + theirs
            elif comp.kind is StateKind.SWA_RING:
                positions = np.arange(max(0, seq - comp.window), seq)
                assert ours == (t.src_row * comp.ring_size + positions % comp.ring_size).tolist()
            else:  # MAMBA: the row's slot
                assert ours == [int(np.asarray(comp.slot_map)[t.src_row])]
            checked += 1
    assert checked >= len(LENGTHS)


@pytest.mark.parametrize("engine", sorted(DRIVERS))
@pytest.mark.parametrize("src_tp, dst_tp", [(4, 8), (8, 4), (2, 8)])
@pytest.mark.parametrize("replicated", [False, True])
def test_mamba_state_sliced_between_tp_sizes_equals_sglang_s(sglang, monkeypatch, engine, src_tp, dst_tp, replicated):
    """Mamba state between TP sizes (docs/tp_state.md §4): a GDN conv in query | key | value groups, a
    temporal state, a tensor of two outer rows and (``replicated``) an item every rank holds whole.
    SGLang's ``_send_mamba_state_slice`` (``maybe_send_extra``), given the shards kvplan's sides
    declare, posts the blocks of kvplan's plan, on a scattering and a gathering pair of ranks.

    A difference by design: SGLang's NIXL path refuses replicated Mamba items between TP sizes, while
    its Mooncake path and kvplan move them (one source rank per destination writes them)."""
    from kvplan.tools.scenarios import build_batch, paired_ranks
    from tests.transport.handoff import LENGTHS, MAMBA_TENSORS, MAMBA_TP4TO8

    tensors = MAMBA_TENSORS if replicated else MAMBA_TENSORS[:3]
    model = replace(MAMBA_TP4TO8, src_tp=src_tp, dst_tp=dst_tp,
                    state=(replace(MAMBA_TP4TO8.state[0], entries=len(tensors), tensors=tensors),))
    src_rank, dst_rank = paired_ranks(src_tp, dst_tp)
    batch = build_batch(model, requests=len(LENGTHS), prompt_len=list(LENGTHS), chunks=2, seed=5, src_rank=src_rank,
                        dst_rank=dst_rank)
    plan = plan_reference(batch)
    assert plan.transfers[-1].state[0].descs[:, 2].min() < batch.src.state[0].entries[0].item_len  # items are sliced
    src_args, dst_args = kv_args_of(sglang, batch.src, src_rank), kv_args_of(sglang, batch.dsts[0], dst_rank)
    driver = DRIVERS[engine](sglang, src_args, dst_args, mla=False, src_tp=src_tp, dst_tp=dst_tp,
                             monkeypatch=monkeypatch)
    lists = [([np.asarray(c.src_list, np.int32) for c in tp.state], [list(map(int, ids)) for ids in t.dst_state])
             for t, tp in zip(batch.transfers, plan.transfers) if t.last]
    if engine == "nixl" and replicated:
        with pytest.raises(RuntimeError, match="Replicated Mamba PD state transfer currently requires"):
            driver.state(*lists[0])
        return
    for src_lists, dst_lists in lists:
        driver.state(src_lists, dst_lists)
    ours = np.concatenate([c.descs for tp in plan.transfers for c in tp.state]).reshape(-1, 3)
    assert byte_ranges(ours) == byte_ranges(driver.blocks)


# -- kvplan's own code on the same sends: the adapter's page mapping, the device planner, the endpoint ----

class PostRecorder(FakeEngine):
    """An engine that records every descriptor list kvplan posts (and completes each at once)."""

    def __init__(self, name: str, memory: str = "DRAM", device_id: int = 0, **settings):
        super().__init__()
        self.memory = memory


def adapter_posts(sglang, src_args, dst, batch, *, mla: bool, src_tp: int) -> np.ndarray:
    """Every descriptor kvplan's SGLang adapter posts when SGLang's prefill scheduler drives it with the
    batch's chunks: ``pop_decode_prefix_len`` and ``init`` per request, then ``send`` of each chunk's
    page ids (SGLang's ``kv_to_page_indices`` over its ``req_to_token``, with ``num_kv_tokens``), then
    ``poll``. The decode side is a peer on an in-memory channel that published the batch's lists; the
    plan is made by the device planner (interpreted on the CPU) and posted to a recording engine."""
    from kvplan.integrations.sglang.adapter import KVManager, KVSender
    from kvplan.planner.contract.plan import DestinationLists
    from kvplan.transport.prefill import Peer

    utils = sglang_module("srt.disaggregation.utils")
    ps = batch.src.kv.page_size
    server_args = types.SimpleNamespace(disaggregation_transfer_backend="differential-recorder",
                                        disaggregation_bootstrap_port=0, kvplan_bootstrap="direct",
                                        kvplan_host="127.0.0.1", attn_tp_size=src_tp, max_running_requests=8,
                                        context_length=batch.src.req_to_token.shape[1], kvplan_mode="direct")
    mgr = KVManager(src_args, utils.DisaggregationMode.PREFILL, server_args, is_mla_backend=mla)
    try:
        peer = Peer(FakeChannel.pair()[0], name="peer", side=dst)
        mgr.prefill.peers.append(peer)
        senders = {}
        for t in batch.transfers:
            if t.request in senders:
                continue
            peer.lists[t.request] = (DestinationLists(np.asarray(t.dst_pages, np.int64), ()), t.aux_dst, t.prefix_len)
            sender = senders[t.request] = KVSender(mgr, "127.0.0.1:0", t.request)
            assert sender.pop_decode_prefix_len() == t.prefix_len  # what SGLang's finalize_bootstrap reads
            sender.init(-(-(t.prompt_len - t.prefix_len) // ps), aux_index=t.aux_src)
        table = torch.from_numpy(np.asarray(batch.src.req_to_token))
        for t in batch.transfers:
            end = t.prompt_len if t.last else t.fill_len // ps * ps
            pages = sglang.pages.kv_to_page_indices(table[t.src_row, t.start:end], ps).astype(np.int32)
            senders[t.request].send(pages, num_kv_tokens=end - t.start)
        polls = poll_until_concluded(senders, sglang.base.KVPoll)  # (the batch moves on the progress thread)
        assert all(p == sglang.base.KVPoll.Success for p in polls.values()), (polls, mgr.failures)
        return np.concatenate([descs for descs, _ in mgr.engine.posted]) if mgr.engine.posted else np.zeros((0, 3))
    finally:
        mgr.close()


@pytest.mark.parametrize("engine", sorted(DRIVERS))
@pytest.mark.parametrize("mla, heads, src_tp, src_rank, dst_tp, dst_rank", LAYOUTS)
def test_the_adapter_posts_sglang_s_byte_ranges(sglang, monkeypatch, engine, mla, heads, src_tp, src_rank, dst_tp,
                                                dst_rank):
    """kvplan's own path, not its reference: SGLang's sends through the adapter's page mapping and the
    device planner, against SGLang's own planning of the same sends, with decode prefixes and chunks."""
    from kvplan.transport.engines import registry

    monkeypatch.setitem(registry._ENGINES, "differential-recorder", PostRecorder)  # for this test only
    @settings(max_examples=3, deadline=None)
    @given(page_size=st.sampled_from([1, 4, 16]), layers=st.integers(1, 2), requests=st.integers(1, 3),
           prefix_pages=st.integers(1, 2), seed=st.integers(0, 2**31))
    def check(page_size, layers, requests, prefix_pages, seed):
        src_args, dst_args, src, dst = layout_sides(sglang, layers, page_size, mla, heads, src_tp, src_rank, dst_tp,
                                                    dst_rank)
        batch = random_batch(np.random.default_rng(seed), src, dst, requests, prefix_pages, chunked=True)
        batch = replace(batch, transfers=tuple(replace(t, request=int(t.request[1:])) for t in batch.transfers))
        ours = adapter_posts(sglang, src_args, dst, batch, mla=mla, src_tp=src_tp)
        driver = DRIVERS[engine](sglang, src_args, dst_args, mla=mla, src_tp=src_tp, dst_tp=dst_tp,
                                 monkeypatch=monkeypatch)
        assert byte_ranges(ours) == byte_ranges(drive(sglang, driver, batch))

    check()
