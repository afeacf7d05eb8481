"""kvplan's plan against what SGLang 0.5.23's own Mooncake KV manager would post, for the same
``KVArgs`` and indices, as sets of byte ranges.

SGLang's ``MooncakeKVManager`` is built without its constructor (no engine, no threads, no
sockets); its transfer engine is a recorder of ``batch_transfer_sync`` calls and its memory
configuration a namespace with ``enable_unified_memory=False`` (the default). Everything else it
runs is its own planning code: ``send_kvcache`` (``group_concurrent_contiguous`` per layer),
``send_kvcache_slice`` (one block per token and head slice) and ``send_aux``. The indices are the
ones SGLang's scheduler hands it: the chunk's page ids by SGLang's own ``kv_to_page_indices`` over
``req_to_token``, the decode's pages sliced at the chunk's first page.
"""

from __future__ import annotations

import concurrent.futures
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.integrations.sglang import side_from_kv_args
from kvplan.planner.model import Batch, Transfer
from kvplan.planner.reference import plan_reference
from tests.sglang_real import sglang_module

pytestmark = pytest.mark.sglang


class Recorder:
    """SGLang's transfer engine, replaced: it records every block and moves nothing."""

    def __init__(self):
        self.blocks: list[tuple[int, int, int]] = []

    def batch_transfer_sync(self, session_id, src_addrs, dst_addrs, lengths) -> int:
        self.blocks += [(int(s), int(d), int(n)) for s, d, n in zip(src_addrs, dst_addrs, lengths)]
        return 0


@pytest.fixture(scope="module")
def sglang():
    conn = sglang_module("srt.disaggregation.mooncake.conn")
    return types.SimpleNamespace(conn=conn, base=sglang_module("srt.disaggregation.base.conn"),
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
    return args


def manager(sglang, args, *, mla: bool, attn_tp_size: int, monkeypatch):
    monkeypatch.setattr(sglang.conn, "get_memory", lambda: types.SimpleNamespace(enable_unified_memory=False))
    mgr = object.__new__(sglang.conn.MooncakeKVManager)
    mgr.kv_args, mgr.is_mla_backend, mgr.is_hybrid_mla_backend = args, mla, False
    mgr.pp_size, mgr.attn_tp_size = 1, attn_tp_size
    mgr.enable_custom_mem_pool, mgr.custom_mem_pool_type = False, None
    mgr.max_transfer_batch_indices, mgr.state_strides_validated = 0, set()
    mgr.engine = Recorder()
    return mgr


def sglang_blocks(sglang, mgr, batch, dst_args, *, head_sliced: bool, dst_tp: int) -> list[tuple[int, int, int]]:
    """Every block SGLang posts for the batch's transfers, chunk by chunk as its scheduler sends them."""
    table = torch.from_numpy(np.asarray(batch.src.req_to_token))
    ps = batch.src.kv.page_size
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        for t in batch.transfers:
            end = t.prompt_len if t.last else t.fill_len // ps * ps
            src_pages = sglang.pages.kv_to_page_indices(table[t.src_row, t.start:end], ps).astype(np.int32)
            first = (t.start - t.prefix_len) // ps
            dst_pages = np.asarray(t.dst_pages, np.int32)[first : first + len(src_pages)]
            if head_sliced:
                ret = mgr.send_kvcache_slice("peer", src_pages, dst_args.kv_data_ptrs, dst_pages,
                                             dst_args.engine_rank, dst_tp, dst_args.kv_item_lens[0], executor)
            else:
                ret = mgr.send_kvcache("peer", src_pages, dst_args.kv_data_ptrs, dst_pages, executor)
            assert ret == 0
            if t.last:
                info = types.SimpleNamespace(mooncake_session_id="peer", dst_aux_index=t.aux_dst)
                assert mgr.send_aux(info, t.aux_src, dst_args.aux_data_ptrs) == 0
    return mgr.engine.blocks


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


@pytest.mark.parametrize("mla, heads, src_tp, src_rank, dst_tp, dst_rank", LAYOUTS)
def test_kv_and_aux_byte_ranges_equal_sglang_s(sglang, monkeypatch, mla, heads, src_tp, src_rank, dst_tp, dst_rank):
    @settings(max_examples=12, deadline=None)
    @given(page_size=st.sampled_from([1, 4, 16]), layers=st.integers(1, 3), requests=st.integers(1, 4),
           prefix_pages=st.integers(0, 2), chunked=st.booleans(), seed=st.integers(0, 2**31))
    def check(page_size, layers, requests, prefix_pages, chunked, seed):
        bph = 8  # bytes per head and token
        shape = dict(layers=layers, mla=mla, page_size=page_size, num_pages=128, heads=heads, aux_items=(16, 48))
        src_args = kv_args(sglang, base=1 << 48, token_bytes=bph * (1 if mla else max(1, heads // src_tp)),
                           tp_size=src_tp, rank=src_rank, **shape)
        dst_args = kv_args(sglang, base=2 << 48, token_bytes=bph * (1 if mla else max(1, heads // dst_tp)),
                           tp_size=dst_tp, rank=dst_rank, **shape)
        src = side_from_kv_args(src_args, mla=mla, attn_tp_size=src_tp)
        dst = side_from_kv_args(dst_args, mla=mla, attn_tp_size=dst_tp)
        batch = random_batch(np.random.default_rng(seed), src, dst, requests, prefix_pages, chunked)
        ours = plan_reference(batch).descriptors()[0]
        mgr = manager(sglang, src_args, mla=mla, attn_tp_size=src_tp, monkeypatch=monkeypatch)
        theirs = sglang_blocks(sglang, mgr, batch, dst_args, head_sliced=src_tp != dst_tp and not mla, dst_tp=dst_tp)
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
    args.state_dim_per_tensor = [[] for _ in side.state]
    args.state_slice_outer_counts = [[] for _ in side.state]
    args.state_conv_shard_groups = [[] for _ in side.state]
    return args


@pytest.mark.parametrize("shape", ["ring_mamba", "swa16", "dsa16"])
@pytest.mark.parametrize("prefix_len, chunks", [(0, 1), (0, 2), (32, 2)])
def test_state_kinds_and_aux_byte_ranges_equal_sglang_s(sglang, monkeypatch, shape, prefix_len, chunks):
    """An SWA ring and Mamba state (MHA), SWA state (MHA, gpt-oss-like) and DSA indexer pages (MLA,
    as SGLang has them only with MLA) with KV and aux: the state lists kvplan computes, handed to
    SGLang's ``maybe_send_extra`` with the decode's published lists, give the blocks of kvplan's
    plan."""
    from kvplan.planner.model import Attention
    from kvplan.tools.scenarios import build_batch
    from tests.transport.handoff import LENGTHS, SHAPES

    model = SHAPES[shape]
    batch = build_batch(model, requests=len(LENGTHS), prompt_len=list(LENGTHS), chunks=chunks,
                        prefix_len=prefix_len, seed=5)
    plan = plan_reference(batch)
    mla = model.attention is Attention.MLA
    src_args, dst_args = kv_args_of(sglang, batch.src), kv_args_of(sglang, batch.dsts[0])
    mine = side_from_kv_args(src_args, mla=mla, req_to_token=batch.src.req_to_token, state=batch.src.state)
    assert (mine.kv, mine.aux) == (batch.src.kv, batch.src.aux)  # the mapping round-trips
    mgr = manager(sglang, src_args, mla=mla, attn_tp_size=1, monkeypatch=monkeypatch)
    monkeypatch.setattr(sglang.conn, "get_parallel", lambda: types.SimpleNamespace(enable_kv_cache_sharding=False))
    mgr.state_tp_size, mgr.request_status = 1, {}
    target = types.SimpleNamespace(
        dst_state_data_ptrs=dst_args.state_data_ptrs, dst_state_item_lens=dst_args.state_item_lens,
        dst_state_dim_per_tensor=dst_args.state_dim_per_tensor, dst_state_layer_ids=dst_args.state_layer_ids,
        dst_attn_tp_size=1, dst_tp_rank=0)
    sglang_blocks(sglang, mgr, batch, dst_args, head_sliced=False, dst_tp=1)  # KV and aux
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        for t, tp in zip(batch.transfers, plan.transfers):
            if not t.last:
                continue
            req = types.SimpleNamespace(mooncake_session_id="peer", room=0, dst_aux_index=t.aux_dst,
                                        dst_state_indices=[list(map(int, ids)) for ids in t.dst_state])
            mgr.request_status[0] = sglang.base.KVPoll.Transferring
            src_lists = [np.asarray(c.src_list, np.int32) for c in tp.state]
            assert mgr.maybe_send_extra(req, src_lists, executor, target) == 0
    assert byte_ranges(plan.descriptors()[0]) == byte_ranges(mgr.engine.blocks)


@pytest.mark.parametrize("shape", ["ring_mamba", "swa16", "dsa16"])
@pytest.mark.parametrize("prefix_len", [0, 32])
def test_state_lists_are_sglang_s_payloads_and_the_prefix_variants_are_named(sglang, shape, prefix_len):
    """The source's state lists against SGLang 0.5.23's payloads (``PrefillMixin.send_kv_chunk`` in
    ``disaggregation/prefill.py``: ``_swa_payload``, ``_dsa_pages_payload``, ``_swa_ring_payload``,
    ``_mamba_payload``). Those are closures over a live scheduler, so their formulas are restated
    here around SGLang's own ``kv_to_page_indices`` and ``suffix_page_indices``.

    Named differences (docs/planning.md §6, "optional later variants"): with a decode prefix
    ``P > 0``, 0.5.23 starts the SWA window at ``max(P, seq - W)`` and sends DSA pages of
    ``[P, seq)``; kvplan starts at ``max(0, seq - W)`` and sends DSA pages of ``[0, seq)``, so its
    lists are SGLang's with the prefix's pages in front (the decode side publishes the same, so
    they pair). With ``P = 0`` they are equal."""
    from kvplan.planner.model import StateKind
    from kvplan.tools.scenarios import build_batch
    from tests.transport.handoff import LENGTHS, SHAPES

    batch = build_batch(SHAPES[shape], requests=len(LENGTHS), prompt_len=list(LENGTHS), chunks=2,
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
                assert ours == prefix_pages + theirs
            elif comp.kind is StateKind.SWA:
                full_to_swa = torch.from_numpy(np.asarray(comp.slot_map))
                start = max(p, seq - comp.window) // ps * ps  # 0.5.23: max(decode_prefix_len, seq - W)
                theirs = sglang.pages.kv_to_page_indices(full_to_swa[table[t.src_row, start:seq]], ps).tolist()
                start0 = max(0, seq - comp.window) // ps * ps  # kvplan, and 0.5.23 whenever P <= that
                extra = sglang.pages.kv_to_page_indices(full_to_swa[table[t.src_row, start0:start]], ps).tolist() \
                    if start > start0 else []
                assert ours == extra + theirs
            elif comp.kind is StateKind.SWA_RING:
                positions = np.arange(max(0, seq - comp.window), seq)
                assert ours == (t.src_row * comp.ring_size + positions % comp.ring_size).tolist()
            else:  # MAMBA: the row's slot
                assert ours == [int(np.asarray(comp.slot_map)[t.src_row])]
            checked += 1
    assert checked >= len(LENGTHS)
