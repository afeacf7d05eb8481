"""kvplan's vLLM connector against vLLM 0.33.0's own code.

(a) vLLM's connector factory builds it from a ``KVTransferConfig`` naming this package, both roles; the
    worker side takes the KV caches vLLM allocates (per layer or across layers); the KV cache groups,
    layouts and settings it does not cover are refused naming them.
(b) The same requests go through vLLM's ``NixlPushConnectorScheduler`` and kvplan's scheduler side;
    both decide alike what loads remotely, into which blocks, and which blocks a prefill keeps.

vLLM runs here on the CPU (``VLLM_TARGET_DEVICE=cpu``), in vLLM's environment (``make setup-vllm``: its own
torch and what its connector modules import, not its GPU kernels); the module is skipped where vLLM is not
installed.
"""

import contextlib
import os
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
vllm = pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed (make setup-vllm)")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvplan.errors import KvplanError, LayoutError  # noqa: E402
from kvplan.integrations.vllm import KvplanConnector  # noqa: E402
from kvplan.integrations.vllm.groups import transfer_groups  # noqa: E402
from kvplan.integrations.vllm.kv_caches import BlockView  # noqa: E402
from kvplan.integrations.vllm.scheduler import ReceiveRequest, SchedulerStep, UnsupportedConfig  # noqa: E402
from kvplan.integrations.vllm.worker import FINISHED_GRACE  # noqa: E402
from kvplan.planner.contract.batch import Attention, TensorShard  # noqa: E402
from kvplan.planner.contract.pairing import pair_sides  # noqa: E402
from tests.ports import free_port  # noqa: E402
from tests.integrations.vllm_fakes import (BLOCK, ENGINE, Blocks, full_attention, hybrid_attention, kv_caches,  # noqa: E402
                                           mamba_hybrid, request, vllm_config)

pytestmark = pytest.mark.vllm

PREFILL = {"remote_engine_id": "p-engine", "remote_request_id": "p-req", "remote_host": "10.0.0.3",
           "remote_port": 17500, "tp_size": 1, "remote_block_ids": [1, 2, 3]}  # what a prefill returned


# -- (a) the factory ---------------------------------------------------------------------------------
def test_vllm_s_factory_builds_the_scheduler_side_from_a_kv_transfer_config():
    config = vllm_config()
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, full_attention(["l0", "l1"]))
    assert isinstance(connector, KvplanConnector) and connector.role is KVConnectorRole.SCHEDULER
    assert connector.scheduler.listen.host == "127.0.0.1" and connector.scheduler.listen.port == 17500
    assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)  # (vLLM's hybrid manager stays on)


def test_vllm_s_factory_builds_the_worker_side_and_it_takes_vllm_s_kv_caches():
    config = vllm_config(role="kv_producer", extra={"host": "127.0.0.1", "port": free_port()})
    kv_cache = full_attention(["model.layers.0.attn", "model.layers.1.attn"], num_blocks=8, heads=2, head_size=16,
                              layout=KVCacheLayout.LBNHC)
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache)
    try:
        assert connector.role is KVConnectorRole.WORKER and connector.scheduler is None
        connector.register_kv_caches(kv_caches(kv_cache, KVCacheLayout.LBNHC))
        assert connector.worker.prefill is not None and connector.worker.listener is not None  # (a producer listens)
        assert connector.get_transfer_results(set()).finished_sending == set()
        assert connector.get_block_ids_with_load_errors() == set()
    finally:
        connector.shutdown()


@pytest.mark.parametrize("layout, cross, items", [(KVCacheLayout.LBHNC, False, 3), (KVCacheLayout.LBNHC, False, 3),
                                                  (KVCacheLayout.BLHNC, True, 1), (KVCacheLayout.BLNHC, True, 1)])
def test_vllm_s_kv_caches_become_blocks_per_layer_or_across_layers(layout, cross, items):
    names = [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 10)]  # (ordered by number: 10 after 1)
    kv_cache = full_attention(names, num_blocks=20, heads=2, head_size=8, layout=layout)
    caches = kv_caches(kv_cache, layout)
    view = BlockView.of(caches, BLOCK)
    page = kv_cache.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    assert view.cross_layer is cross and len(view.entries) == items and view.num_blocks == 20
    assert view.layers == tuple(names)
    for entry in view.entries:  # each item is a block: one layer's, or every layer's
        assert entry.item_len == page * (3 if cross else 1) and entry.num_items == 20
    if not cross:  # block b of layer l starts where vLLM's view of it does
        assert [e.base_ptr + 5 * e.item_len for e in view.entries] == [caches[n][5].data_ptr() for n in names]
    else:
        assert view.entries[0].base_ptr + 5 * view.entries[0].item_len == min(caches[n][5].data_ptr() for n in names)
    assert layout.name not in view.word and ("cross-layer" in view.word) is cross  # (the byte order, not the name)


@pytest.mark.parametrize("layout, by_head, kind", [(KVCacheLayout.LBNHC, True, Attention.MHA_PACKED),
                                                   (KVCacheLayout.LBHNC, True, Attention.MHA_HEAD_MAJOR),
                                                   (KVCacheLayout.BLNHC, False, Attention.MLA),
                                                   (KVCacheLayout.BLHNC, False, Attention.MLA)])
def test_sides_of_other_block_or_tp_sizes_share_a_word_only_where_a_layer_s_blocks_hold_its_heads_and_tokens(
        layout, by_head, kind):
    """Where a layer's block holds heads and tokens, the word names neither count (the pairing checks them: TP
    sizes for both layouts, block sizes where the tokens lie outside the heads); elsewhere blocks move whole and
    the word names the block size. A rank of one head looks the same in LBNHC and LBHNC."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    views = {}
    for block in (16, 32):
        kv_cache = full_attention(names, num_blocks=20, heads=2, head_size=8, layout=layout, block_size=block)
        views[block] = BlockView.of(kv_caches(kv_cache, layout), block)
    assert (views[16].word == views[32].word) is by_head, views
    assert views[16].side(tp_size=2).kv.attention is kind
    other_heads = BlockView.of(kv_caches(full_attention(names, num_blocks=20, heads=4, head_size=8, layout=layout),
                                         layout), BLOCK)
    assert (other_heads.word == views[16].word) is by_head  # (another TP size: heads counted by the pairing)
    assert other_heads.slices_heads is by_head and (other_heads.heads == 4) is by_head
    one_head = BlockView.of(kv_caches(full_attention(names, num_blocks=20, heads=1, head_size=8, layout=layout),
                                      layout), BLOCK)
    assert (one_head.word == views[16].word) is by_head
    if by_head:  # a rank of one head pairs with its peer's kind; another block size only where tokens lie outside
        assert one_head.side(tp_size=2).kv.attention is Attention.MHA_PACKED
        pair_sides(views[16].side(tp_size=1), one_head.side(tp_size=2, tp_rank=1))
        other_block = views[32].side(tp_size=1)
        if kind is Attention.MHA_HEAD_MAJOR:
            with pytest.raises(LayoutError, match="page sizes must be equal"):
                pair_sides(views[16].side(tp_size=1), other_block)
        else:
            pair_sides(views[16].side(tp_size=1), other_block)
    other_head_size = BlockView.of(kv_caches(full_attention(names, num_blocks=20, heads=2, head_size=16,
                                                            layout=layout), layout), BLOCK).word
    assert other_head_size != views[16].word  # (what a head holds must match)


def test_kv_caches_whose_blocks_are_not_one_span_are_refused_naming_the_layer():
    heads_outside = torch.zeros(2, 20, 16, 16, dtype=torch.bfloat16).permute(1, 0, 2, 3)  # [B, H, N, C], H outermost
    with pytest.raises(LayoutError, match="layer model.layers.0.attn .*heads outside the blocks"):
        BlockView.of({"model.layers.0.attn": heads_outside}, BLOCK)
    mixed = {"a.0": torch.zeros(20, 2, 16, 16), "a.1": torch.zeros(20, 2, 16, 16, dtype=torch.bfloat16)}
    with pytest.raises(LayoutError, match="one KV cache group of alike layers"):
        BlockView.of(mixed, BLOCK)


@contextlib.contextmanager
def registered_worker(kv_cache):
    """A worker connector over ``kv_cache`` with vLLM's ``LBHNC`` views of it registered; shut down after."""
    connector = KVConnectorFactory.create_connector(vllm_config({"host": "127.0.0.1", "port": free_port()}),
                                                    KVConnectorRole.WORKER, kv_cache)
    try:
        caches = kv_caches(kv_cache, KVCacheLayout.LBHNC)
        connector.register_kv_caches(caches)
        yield connector, caches
    finally:
        connector.shutdown()


def test_a_worker_of_a_model_with_several_full_attention_groups_is_refused():
    with pytest.raises(UnsupportedConfig, match="2 full-attention KV cache groups"):
        KVConnectorFactory.create_connector(vllm_config(), KVConnectorRole.WORKER, full_attention(["l0"], ["l1"]))


def test_a_worker_takes_a_full_attention_group_and_a_sliding_window_group_over_the_same_memory():
    """vLLM's hybrid KV cache manager overlays the groups in one allocation: the worker's side has the full
    group's blocks as KV and the sliding-window group's as a SWA component of window ``sliding_window - 1``
    (the tokens vLLM keeps besides the next), from the decode's prefix on."""
    names = ["model.layers.0.attn", "model.layers.2.attn"], ["model.layers.1.attn", "model.layers.3.attn"]
    kv_cache = hybrid_attention(*names, 48, num_blocks=8, heads=2, head_size=16)
    with registered_worker(kv_cache) as (connector, caches):
        side = connector.worker.prefill.side
        (window,) = side.state
        assert [e.base_ptr for e in side.kv.entries] == [caches[n].data_ptr() for n in names[0]]
        assert [e.base_ptr for e in window.entries] == [caches[n].data_ptr() for n in names[1]]
        assert window.kind.value == "swa" and window.window == 47 and window.from_prefix
        assert connector.get_block_ids_with_load_errors() == set()


@pytest.mark.parametrize("window_block, window_heads", [(4, 2), (32, 1)])
def test_a_sliding_window_group_of_another_block_size_is_a_component_of_its_own_pages_moved_whole(window_block,
                                                                                               window_heads):
    """vLLM unifies page bytes: a sliding-window group of 4-token blocks padded to the full group's 16-token page,
    or of 32-token blocks of half the heads. Either is a SWA component of its own page size whose items are its
    blocks' strides, moved whole: the layout word names its shape, so a peer of other heads does not pair."""
    names = ["model.layers.0.attn", "model.layers.2.attn"], ["model.layers.1.attn", "model.layers.3.attn"]
    kv_cache = hybrid_attention(*names, 48, num_blocks=8, heads=2, head_size=16,
                                window_block_size=min(window_block, BLOCK))
    if window_block > BLOCK:  # (the same page bytes: vLLM's unify_kv_cache_spec_page_size)
        group = kv_cache.kv_cache_groups[1]
        group.kv_cache_spec = replace(group.kv_cache_spec, block_size=window_block, num_kv_heads=window_heads)
    page = kv_cache.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    assert kv_cache.kv_cache_groups[1].kv_cache_spec.page_size_bytes == page
    with registered_worker(kv_cache) as (connector, caches):
        side = connector.worker.prefill.side
        (window,) = side.state
        assert side.kv.page_size == BLOCK and window.page_size == window_block
        assert [(e.base_ptr, e.item_len) for e in window.entries] == [(caches[n].data_ptr(), page) for n in names[1]]
        assert f"/swa48:2xvllm-kv/bfloat16/({window_heads}, {window_block}, 32)/" in connector.worker.view.word
        assert connector.worker._send_maps.block_sizes == (window_block,)
    if window_block < BLOCK:  # a rank of TP 2 holds half the heads: its word differs, so the endpoints never pair
        half = hybrid_attention(*names, 48, num_blocks=8, heads=1, head_size=16, window_block_size=window_block)
        view = BlockView.of_groups(kv_caches(half, KVCacheLayout.LBHNC), transfer_groups(half, 2), BLOCK)
        assert view.word != connector.worker.view.word and view.windows[0][1].entries[0].item_len == page // 2


def test_a_worker_takes_a_mamba_group_over_the_same_memory_as_a_mamba_component_of_padded_blocks():
    """vLLM hands a Mamba layer as a byte view ``[blocks, 1, 1, state bytes]`` whose blocks lie one attention
    page apart (the state padded to it): each layer is an entry per tensor over its page (the conv state, then
    the temporal state), each naming its span and how it is sharded, the group a Mamba component found by
    planning row. A request whose state list is vLLM's null block is refused, named; a prefill of another TP
    size is served by the ranks that hold this rank's part."""
    names = ["model.layers.0.attn", "model.layers.2.attn"], ["model.layers.1.mixer", "model.layers.3.mixer"]
    kv_cache = mamba_hybrid(*names, num_blocks=8, heads=2, head_size=16)
    page = kv_cache.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    with registered_worker(kv_cache) as (connector, caches):
        (state,) = connector.worker.prefill.side.state
        assert state.kind.value == "mamba" and state.slot_map is not None
        assert [(e.base_ptr, e.item_len, e.num_items) for e in state.entries] == \
            [(caches[n].data_ptr(), page, 8) for n in names[1] for _ in range(2)]
        conv = 3 * 32 * 2  # (bf16)
        assert state.shards == (TensorShard(32, 3, (16, 8, 8), 0, conv), TensorShard(4, 1, (), conv, 4 * 4 * 8 * 4)) * 2
        assert "/mamba:4xsharded" in connector.worker.view.word
        worker = connector.worker
        receive = ReceiveRequest(([3, 4], [0]), 20, "p", "p-req", "127.0.0.1", free_port(), 1)
        with pytest.raises(KvplanError, match="Mamba group 0 holds no state block"):
            worker._admit("d", receive)
        assert worker._prefill_ranks(replace(receive, remote_tp_size=2)) == (0, 1)


def test_mamba_state_of_a_kind_whose_sharding_is_unknown_moves_whole_pages_between_equal_tp_sizes_only():
    names = ["model.layers.0.attn"], ["model.layers.1.mixer"]
    kv_cache = mamba_hybrid(*names, num_blocks=8, heads=2, head_size=16, mamba_type=MambaAttentionBackendEnum.LINEAR)
    page = kv_cache.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    with registered_worker(kv_cache) as (connector, caches):
        (state,) = connector.worker.prefill.side.state
        assert [(e.item_len, state.shards) for e in state.entries] == [(page, ())]
        receive = ReceiveRequest(([3, 4], [5]), 20, "p", "p-req", "127.0.0.1", free_port(), 2)
        with pytest.raises(KvplanError, match="Mamba state of this kind between equal TP sizes only"):
            connector.worker._prefill_ranks(receive)


@pytest.mark.parametrize("extra, named", [({"port": 0}, "port 0"), ({"port": "17500"}, "port '17500'"),
                                          ({"hots": "10.0.0.1"}, "unknown keys"), ({"host": ""}, "host ''"),
                                          ({"engine": "rdma"}, "engine 'rdma'"), ({"engine_settings": [1]}, "not a map"),
                                          ({"timeout_s": 0}, "timeout_s 0"), ({"max_requests": 0}, "max_requests 0"),
                                          ({"mode": "prepared", "engine": "mooncake"}, "mode 'prepared'"),
                                          ({"mode": "pipelined"}, "mode .pipelined."),
                                          ({"staging_mib": -1}, "staging_mib -1"),
                                          ({"warm_up": {"max_transfers": 4}}, "warm_up"),
                                          ({"warm_up": {"max_transfers": 0, "max_prompt_len": 8}}, "warm_up"),
                                          ({"layout": "LHBNC"}, "layout 'LHBNC'"),
                                          ({"secret_file": ""}, "secret_file ''"),
                                          ({"secret": "in the config"}, "unknown keys"),
                                          ({"integrity": "yes"}, "integrity 'yes' is not true or false"),
                                          ({"integrity": True, "mode": "prepared"}, "integrity needs every byte"),
                                          ({"engine_settings": {"num_thread": 4}}, "nixl has no setting 'num_thread'"),
                                          ({"engine": "mooncake", "engine_settings": {"protocol": "carrierpigeon"}},
                                           "mooncake's protocol='carrierpigeon'; it takes one of tcp"),
                                          ({"engine_settings": {"progress_thread": "maybe"}},
                                           "nixl's progress_thread='maybe'; it takes true or false")])
def test_settings_that_cannot_work_are_refused_naming_them(extra, named):
    with pytest.raises(UnsupportedConfig, match=named):
        KVConnectorFactory.create_connector(vllm_config(extra), KVConnectorRole.SCHEDULER, full_attention(["l0"]))


def test_groups_and_lookahead_it_does_not_cover_are_refused_naming_them():
    local = KVCacheGroupSpec(["local.0", "local.1", "local.2"],
                             ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128,
                                                       dtype=torch.bfloat16, attention_chunk_size=128))
    mixed = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[*full_attention(["l0"]).kv_cache_groups,
                                                                               local])
    with pytest.raises(UnsupportedConfig, match=r"ChunkedLocalAttentionSpec \(local.0, local.1, \.\.\.\)"):
        KVConnectorFactory.create_connector(vllm_config(), KVConnectorRole.SCHEDULER, mixed)
    window_only = hybrid_attention([], ["swa.0"], 64).kv_cache_groups[1:]
    with pytest.raises(UnsupportedConfig, match="0 full-attention KV cache groups"):
        KVConnectorFactory.create_connector(vllm_config(), KVConnectorRole.SCHEDULER,
                                            KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                                                          kv_cache_groups=window_only))
    with pytest.raises(UnsupportedConfig, match="lookahead of 3 tokens"):
        KVConnectorFactory.create_connector(vllm_config(lookahead=3), KVConnectorRole.SCHEDULER, full_attention(["l0"]))


# -- (b) the same decisions as vLLM's NIXL connector in push mode -------------------------------------
@pytest.fixture
def both():
    """vLLM's push scheduler and kvplan's, on the same configuration (a full-attention group and a
    sliding-window group: vLLM passes one block list per group)."""
    config, kv_cache = vllm_config(), hybrid_attention(["l0", "l1"], ["l2", "l3"], 64)
    nixl = NixlPushConnectorScheduler(config, ENGINE, kv_cache)
    ours = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache)
    yield nixl, ours
    nixl.shutdown()


def _each(both, method, make_request, *args, ours_method=None):
    """``method`` called on both schedulers (``ours_method`` on kvplan's connector, where its name differs),
    each with its own copy of the request (they mark its params)."""
    nixl, ours = both
    a, b = make_request(), make_request()
    return getattr(nixl, method)(a, *args), getattr(ours, ours_method or method)(b, *args), a, b


DECODE_CASES = [  # (request id, prompt tokens, computed here, params, blocks allocated, tokens vLLM then loads)
    ("whole", 40, 0, {"do_remote_prefill": True, **PREFILL}, ([3, 4, 5], [9, 10, 11]), 40),
    ("prefix-hit", 40, 32, {"do_remote_prefill": True, **PREFILL}, ([6], [12]), 8),
    ("all-here", 40, 40, {"do_remote_prefill": True, **PREFILL}, ([], []), 0),
    ("local", 40, 0, None, ([7, 8, 9], [13, 14, 15]), 0),
    ("no-flag", 40, 0, {"do_remote_prefill": False, **PREFILL}, ([7], [13]), 0),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_a_decode_loads_the_same_tokens_into_the_same_blocks_as_vllm_s_push_connector(both, case):
    name, prompt, computed, params, allocated, external = case
    nixl, ours = both
    make = lambda: request(name, prompt, params, computed)  # noqa: E731
    theirs, mine, a, b = _each(both, "get_num_new_matched_tokens", make, computed)
    assert mine == theirs
    nixl.update_state_after_alloc(a, Blocks(*allocated), external)
    ours.update_state_after_alloc(b, Blocks(*allocated), external)
    nixl.update_state_after_alloc(a, Blocks(*allocated), external)  # rescheduled: registers nothing more
    ours.update_state_after_alloc(b, Blocks(*allocated), external)
    flag = lambda r: (r.kv_transfer_params or {}).get("do_remote_prefill")  # noqa: E731
    assert flag(b) == flag(a)  # (cleared once registered; kept where nothing loads, so the end frees the prefill)
    meta, step = nixl.build_connector_meta(SimpleNamespace()), ours.build_connector_meta(SimpleNamespace()).step
    assert set(step.receive) == set(meta.reqs_to_recv)
    for rid, recv in step.receive.items():
        assert tuple(recv.block_ids) == tuple(meta.reqs_to_recv[rid].local_block_ids)
        assert (recv.remote_engine_id, recv.remote_request_id) == ("p-engine", "p-req")
        assert recv.num_tokens == external
    assert ours.has_pending_push_work() is False  # (handed over)


def test_a_decode_request_aborted_before_its_blocks_came_frees_the_prefill_s_as_vllm_s_does(both):
    nixl, ours = both
    theirs, mine, _, _ = _each(both, "request_finished",
                               lambda: request("gone", 40, {"do_remote_prefill": True, **PREFILL},
                                               status=RequestStatus.FINISHED_ABORTED), ([], []),
                               ours_method="request_finished_all_groups")
    assert mine == theirs == (False, None)
    meta, step = nixl.build_connector_meta(SimpleNamespace()), ours.build_connector_meta(SimpleNamespace()).step
    assert set(step.receive) == set(meta.reqs_to_recv) == {"gone"}
    assert step.receive["gone"].block_ids == () and step.receive["gone"].num_tokens == 0


PREFILL_CASES = [  # (request id, status, blocks at the end, tokens computed)
    ("finished", RequestStatus.FINISHED_LENGTH_CAPPED, ([7, 8], [20, 21]), 32),
    ("stopped", RequestStatus.FINISHED_STOPPED, ([5], [6]), 12),
    ("aborted", RequestStatus.FINISHED_ABORTED, ([7, 8], [20, 21]), 32),
    ("no-blocks", RequestStatus.FINISHED_LENGTH_CAPPED, ([], []), 0),
]
COMPARED = ("do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
            "tp_size", "remote_num_tokens")  # (host and port: each connector's own listener)


@pytest.mark.parametrize("case", PREFILL_CASES, ids=[c[0] for c in PREFILL_CASES])
def test_a_prefill_keeps_the_same_blocks_and_returns_the_same_parameters_as_vllm_s_push_connector(both, case):
    name, status, blocks, computed = case
    nixl, ours = both
    (keep_a, params_a), (keep_b, params_b), _, _ = _each(
        both, "request_finished", lambda: request(name, 40, {"do_remote_decode": True}, computed, status), blocks,
        ours_method="request_finished_all_groups")  # (vLLM's hybrid manager calls this one with every group's blocks)
    assert keep_b == keep_a
    assert (params_b is None) == (params_a is None)
    if params_a is not None:
        assert {k: params_b[k] for k in COMPARED} == {k: params_a[k] for k in COMPARED}
        assert (params_b["remote_host"], params_b["remote_port"]) == ("127.0.0.1", 17500)
    meta, step = nixl.build_connector_meta(SimpleNamespace()), ours.build_connector_meta(SimpleNamespace()).step
    assert set(step.send) == set(meta.reqs_to_send)
    assert step.not_processed == meta.reqs_not_processed
    assert ours.has_pending_push_work() == nixl.has_pending_push_work() == keep_a
    if keep_a:  # freed once the workers report the write done
        ours.update_connector_output(SimpleNamespace(finished_sending={name}, finished_recving=None))
        assert not ours.has_pending_push_work()


@pytest.fixture
def both_mamba():
    """vLLM's push scheduler and kvplan's on a full-attention group and a Mamba group with two speculative
    scratch blocks after each request's state block (a Mamba block size of its own)."""
    config, kv_cache = vllm_config(), mamba_hybrid(["l0", "l1"], ["m0", "m1"], 64, scratch_blocks=2)
    mamba = kv_cache.kv_cache_groups[1]
    mamba.kv_cache_spec = replace(mamba.kv_cache_spec, block_size=4 * BLOCK)
    nixl = NixlPushConnectorScheduler(config, ENGINE, kv_cache)
    ours = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache)
    yield nixl, ours
    nixl.shutdown()


def test_with_a_mamba_group_the_prefill_leaves_the_last_token_as_vllm_s_push_connector_does(both_mamba):
    """A new prefill request loses its prompt's last token and may output one, once (a preempted one comes
    back shortened already); a decode request is left as it is, and loads all but its prompt's last token."""
    nixl, ours = both_mamba
    for params in ({"do_remote_decode": True}, {"do_remote_prefill": True, **PREFILL}, None):
        a, b = request("r", 40, params), request("r", 40, params)
        for _ in range(2):
            nixl.on_new_request(a)
            ours.on_new_request(b)
        assert (b.prompt_token_ids, b._all_token_ids, b.num_prompt_tokens, b.max_tokens) == \
            (a.prompt_token_ids, a._all_token_ids, a.num_prompt_tokens, a.max_tokens)
        assert len(b.prompt_token_ids) == (39 if params == {"do_remote_decode": True} else 40)
    for computed in (0, 32, 39, 40):
        a = b = request("d", 40, {"do_remote_prefill": True, **PREFILL}, computed)
        assert ours.get_num_new_matched_tokens(b, computed) == nixl.get_num_new_matched_tokens(a, computed)
    assert ours.get_num_new_matched_tokens(b, 0) == (39, True)


def test_with_a_mamba_group_each_side_names_the_state_block_vllm_s_push_connector_names(both_mamba):
    """A Mamba group's list is cut to the block holding the running state: the last before the speculative
    scratch blocks, on the decode (what it publishes) and on the prefill (what it keeps and returns)."""
    nixl, ours = both_mamba
    allocated = ([3, 4, 5], [0, 0, 21, 22, 23])  # (null blocks before the state, two scratch blocks after it)
    a, b = (request("d", 40, {"do_remote_prefill": True, **PREFILL}) for _ in range(2))
    for scheduler, r in ((nixl, a), (ours, b)):
        scheduler.update_state_after_alloc(r, Blocks(*allocated), 39)
    meta, step = nixl.build_connector_meta(SimpleNamespace()), ours.build_connector_meta(SimpleNamespace()).step
    assert tuple(step.receive["d"].block_ids) == tuple(meta.reqs_to_recv["d"].local_block_ids) == ([3, 4, 5], [21])
    assert step.receive["d"].num_tokens == 39 and step.receive["d"].prefix_len == 0
    (keep_a, params_a), (keep_b, params_b), _, _ = _each(
        both_mamba, "request_finished",
        lambda: request("p", 40, {"do_remote_decode": True}, 39, RequestStatus.FINISHED_LENGTH_CAPPED),
        ([7, 8, 9], [30, 31, 32]), ours_method="request_finished_all_groups")
    assert keep_a == keep_b is True
    assert {k: params_b[k] for k in COMPARED} == {k: params_a[k] for k in COMPARED}
    assert params_b["remote_block_ids"] == ([7, 8, 9], [30])


# -- the GPU benchmark's baseline is vLLM's own code ------------------------------------------------
def test_the_benchmark_s_vllm_baseline_computes_vllm_s_own_descriptor_ids():
    """benchmarks/vllm_shapes.py times vLLM's descriptor-id computation with its own NumPy formula (the
    device machine has no vLLM); here it must equal vLLM 0.33's ``_compute_desc_ids`` for full attention."""
    import numpy as np
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    from benchmarks.vllm_shapes import vllm_desc_ids

    layers, num_blocks = 5, 40
    worker = SimpleNamespace(_has_mamba=False, _transfer_layer_group_ids=[], num_regions=layers,
                             block_len_per_layer=[1024] * layers, region_group_ids=[0] * layers,
                             _uses_region_group_mapping=False)
    rng = np.random.default_rng(3)
    for _ in range(5):
        blocks = rng.permutation(np.arange(1, num_blocks))[: rng.integers(1, 20)].tolist()
        theirs = NixlBaseConnectorWorker._compute_desc_ids(worker, block_ids=[blocks], dst_num_blocks=num_blocks,
                                                           block_size_ratio=None, physical_blocks_per_logical=1)
        assert np.array_equal(vllm_desc_ids(blocks, num_blocks, layers), theirs)


def test_the_connector_asks_vllm_for_the_layout_of_its_setting():
    """vLLM asks the connector's class for its KV cache layout (as NixlConnector asks for LBHNC); kvplan's
    asks for its ``layout`` setting where the model has KV heads (LBHNC unless told LBNHC, the layout in which
    block sizes may also differ), nothing for MLA."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout

    config = vllm_config()
    config.model_config.use_mla = False
    assert get_kv_connector_cache_layout(config) == "LBHNC"
    assert KVCacheLayout[get_kv_connector_cache_layout(config)] is KVCacheLayout.LBHNC
    config = vllm_config({"host": "127.0.0.1", "layout": "LBNHC"})
    config.model_config.use_mla = False
    assert KVCacheLayout[get_kv_connector_cache_layout(config)] is KVCacheLayout.LBNHC
    config.model_config.use_mla = True
    assert get_kv_connector_cache_layout(config) is None


def test_the_secret_comes_from_the_file_its_setting_names_never_from_the_config(tmp_path):
    """The SGLang and vLLM settings pass the control plane's secret; vLLM logs its config, so the
    setting names a file (``secret_file``), and a key holding the secret itself is refused above."""
    from kvplan.integrations.vllm.settings import Settings

    path = tmp_path / "secret"
    path.write_text("  the deployment's\n")
    path.chmod(0o600)  # (a secret's file is its owner's alone)
    assert Settings.parse({"host": "127.0.0.1", "secret_file": str(path)}, tp_size=1).secret() == b"the deployment's"
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        Settings.parse({"host": "127.0.0.1", "secret_file": str(path)}, tp_size=1).secret()


def test_off_loopback_a_worker_without_a_secret_does_not_start_and_insecure_is_the_only_opt_out(monkeypatch):
    """Secure by default (docs/failures.md §10): a worker whose host is not loopback stops at start with one
    error saying what to set; ``"insecure": true`` runs it open; a key that is no switch is refused."""
    from kvplan.errors import SettingError
    from kvplan.integrations.vllm.settings import Settings

    for name in ("KVPLAN_SECRET", "KVPLAN_SECRET_FILE", "KVPLAN_INSECURE"):
        monkeypatch.delenv(name, raising=False)
    kv_cache = full_attention(["model.layers.0.attn"], num_blocks=8, heads=2, head_size=16, layout=KVCacheLayout.LBNHC)
    config = vllm_config(role="kv_consumer", extra={"host": "192.0.2.1", "port": free_port()})
    with pytest.raises(SettingError, match=r"192\.0\.2\.1 \(not loopback\) has no shared secret.*KVPLAN_INSECURE=1"):
        KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache)
    config = vllm_config(role="kv_consumer", extra={"host": "192.0.2.1", "port": free_port(), "insecure": True})
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache)
    connector.shutdown()
    assert Settings.parse({"host": "127.0.0.1"}, tp_size=1).insecure is False
    with pytest.raises(UnsupportedConfig, match="insecure 'yes' is not true or false"):
        Settings.parse({"host": "127.0.0.1", "insecure": "yes"}, tp_size=1)


# -- what a decode's worker reports back to vLLM ------------------------------------------------
def _consumer():
    """A decode's worker side, built by vLLM's factory over CPU KV caches."""
    config = vllm_config(role="kv_consumer", extra={"host": "127.0.0.1", "port": free_port()})
    kv_cache = full_attention(["model.layers.0.attn"], num_blocks=8, heads=2, head_size=16, layout=KVCacheLayout.LBNHC)
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache)
    connector.register_kv_caches(kv_caches(kv_cache, KVCacheLayout.LBNHC))
    return connector


def test_a_decode_request_vllm_freed_is_never_reported_even_when_its_prefill_cannot_be_reached():
    """A decode request aborted before its blocks came is freed by vLLM at once; its prefill is only told
    to free its own. Reported back (received and failed) when that prefill could not be reached, it failed
    vLLM's ``assert req_id in self.requests`` and took the decode's engine core down. A request vLLM holds
    is still reported failed."""
    connector = _consumer()
    try:
        port = free_port()  # (no prefill listens there)

        def receive(remote: str, blocks: tuple) -> ReceiveRequest:
            return ReceiveRequest(blocks, len(blocks[0]) * BLOCK if blocks else 0, "p-engine", remote, "127.0.0.1",
                                  port, 1)

        connector.worker.start_load_kv(SchedulerStep(receive={"freed-1": receive("p-1", ()),
                                                              "held": receive("p-2", ([1, 2],))}))
        reported, ends = set(), time.monotonic() + 30
        while "held" not in reported and time.monotonic() < ends:  # (its pairing fails on its own thread)
            reported |= connector.get_finished(set())[1] or set()
            time.sleep(0.05)
        assert reported == {"held"}
        # the prefill is known unreachable now: a request vLLM freed meanwhile is told at once, and fails there
        connector.worker.start_load_kv(SchedulerStep(receive={"freed-2": receive("p-3", ())}))
        for _ in range(3):
            reported |= connector.get_finished(set())[1] or set()
        assert reported == {"held"}
    finally:
        connector.shutdown()


def test_finished_ids_that_are_no_send_of_the_worker_are_not_kept():
    """vLLM names every finished request; only a prefill's sends are ever reported back. Before, each id was
    kept for ever (100,000 finished requests: 100,000 ids, 11.4 MiB on a decode)."""
    connector = _consumer()
    try:
        for call in range(40):
            connector.get_finished({f"r{call}-{i}" for i in range(1000)})
        assert len(connector.worker._finished) <= (FINISHED_GRACE + 1) * 1000
    finally:
        connector.shutdown()


def test_a_load_restores_every_transfer_group_and_sleep_mode_is_refused():
    """vLLM zeroes the new blocks of every group a load does not name (``skip_zeroing_group_ids``), after
    the load may have landed: kvplan's loads write the full-attention group and each sliding-window group,
    so all are named. Sleep mode remaps the KV cache under the engine's registrations: vLLM asks the
    connector's class before it starts (``VllmConfig``), and kvplan's says no (vLLM's default says yes).
    (For the groups kvplan takes, vLLM's default names the same groups: all are prefix-cacheable.)"""
    config, kv_cache = vllm_config(), hybrid_attention(["l0", "l1"], ["l2", "l3"], 64)
    ours = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache)
    loaded = ours.get_loaded_kv_cache_group_ids(request("r", 40, {"do_remote_prefill": True, **PREFILL}))
    assert loaded == kv_cache.transfer_group_ids == (0, 1)
    assert not KVConnectorFactory.get_connector_class(config.kv_transfer_config).supports_sleep_mode(
        config.kv_transfer_config)


def test_a_window_group_s_blocks_keep_their_places_where_vllm_hands_its_null_block():
    """vLLM's scheduler gives a sliding-window group its null block for each block wholly before the window (a
    47-token prompt, window 32, blocks of 16: ``[0, 4, 5]``) and drops those from the head of
    ``get_unhashed_block_ids_all_groups``; the decode keeps them in place, so block ``i`` still holds the
    ``i``-th block of tokens (the prefill's list has its null blocks in the same places)."""
    from tests.integrations.vllm_fakes import kv_blocks

    scheduler = KVConnectorFactory.create_connector(vllm_config(), KVConnectorRole.SCHEDULER,
                                                    hybrid_attention(["l0"], ["w0"], 32))
    r = request("d", 47, {"do_remote_prefill": True, **PREFILL})
    count, is_async = scheduler.get_num_new_matched_tokens(r, 0)
    assert is_async and count > 32
    allocated = kv_blocks([1, 2, 3], [0, 4, 5])
    assert allocated.get_unhashed_block_ids_all_groups() == [[1, 2, 3], [4, 5]]  # (vLLM's own list: shifted)
    scheduler.update_state_after_alloc(r, allocated, count)
    step = scheduler.build_connector_meta(SimpleNamespace()).step
    assert tuple(step.receive["d"].block_ids) == ([1, 2, 3], [0, 4, 5])
