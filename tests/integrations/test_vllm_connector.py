"""kvplan's vLLM connector against vLLM 0.33.0's own code (issue 39, tests (a) and (b)).

(a) vLLM's connector factory builds it from a ``KVTransferConfig`` naming this package: the scheduler
    role works, the worker role (not built yet) is refused with the reason, and so are the KV cache
    groups and settings it does not cover.
(b) The same requests go through vLLM's ``NixlPushConnectorScheduler`` and kvplan's scheduler side;
    both decide alike what loads remotely, into which blocks, and which blocks a prefill keeps.

vLLM runs here on the CPU (``VLLM_TARGET_DEVICE=cpu``), installed without its dependencies
(``make setup-vllm``); the module is skipped where it is not installed.
"""

import os
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
vllm = pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed (make setup-vllm)")

import torch  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import RequestStatus  # noqa: E402

from kvplan.integrations.vllm import KvplanConnector  # noqa: E402
from kvplan.integrations.vllm.connector import WorkerNotBuilt  # noqa: E402
from kvplan.integrations.vllm.scheduler import UnsupportedConfig  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK = 16
ENGINE = "prefill-engine-0"
PREFILL = {"remote_engine_id": "p-engine", "remote_request_id": "p-req", "remote_host": "10.0.0.3",
           "remote_port": 17500, "tp_size": 1, "remote_block_ids": [1, 2, 3]}  # what a prefill returned


def full_attention(*groups_of_layers) -> KVCacheConfig:
    groups = [KVCacheGroupSpec(list(layers), FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128,
                                                                dtype=torch.bfloat16)) for layers in groups_of_layers]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def vllm_config(extra=None, role="kv_both", lookahead=1) -> SimpleNamespace:
    """The parts of a ``VllmConfig`` the factory and both schedulers read (a real one needs a model)."""
    transfer = KVTransferConfig(kv_connector="KvplanConnector", kv_connector_module_path="kvplan.integrations.vllm",
                                kv_role=role, engine_id=ENGINE,
                                kv_connector_extra_config={"host": "127.0.0.1", "port": 17500} if extra is None
                                else extra)
    return SimpleNamespace(
        kv_transfer_config=transfer, num_prefill_lookahead_tokens=lookahead,
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, decode_context_parallel_size=1, data_parallel_index=0,
                                        pipeline_parallel_size=1))


def request(request_id, prompt_len, params, computed=0, status=RequestStatus.RUNNING) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, prompt_token_ids=list(range(prompt_len)), num_prompt_tokens=prompt_len,
                           num_computed_tokens=computed, status=status,
                           kv_transfer_params=None if params is None else dict(params))


class Blocks:
    """What ``update_state_after_alloc`` reads of vLLM's ``KVCacheBlocks``."""

    def __init__(self, *groups):
        self.groups = tuple(list(g) for g in groups)

    def get_unhashed_block_ids_all_groups(self):
        return self.groups


# -- (a) the factory ---------------------------------------------------------------------------------
def test_vllm_s_factory_builds_the_scheduler_side_from_a_kv_transfer_config():
    config = vllm_config()
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, full_attention(["l0", "l1"]))
    assert isinstance(connector, KvplanConnector) and connector.role is KVConnectorRole.SCHEDULER
    assert connector.scheduler.listen.host == "127.0.0.1" and connector.scheduler.listen.port == 17500
    assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)  # (vLLM's hybrid manager stays on)


def test_the_worker_role_is_refused_with_the_reason_rather_than_moving_nothing():
    with pytest.raises(WorkerNotBuilt, match="worker side.*not built yet"):
        KVConnectorFactory.create_connector(vllm_config(), KVConnectorRole.WORKER, full_attention(["l0"]))


@pytest.mark.parametrize("extra, named", [({"port": 0}, "port 0"), ({"port": "17500"}, "port '17500'"),
                                          ({"hots": "10.0.0.1"}, "unknown keys"), ({"host": ""}, "host ''")])
def test_settings_that_cannot_work_are_refused_naming_them(extra, named):
    with pytest.raises(UnsupportedConfig, match=named):
        KVConnectorFactory.create_connector(vllm_config(extra), KVConnectorRole.SCHEDULER, full_attention(["l0"]))


def test_groups_and_lookahead_it_does_not_cover_are_refused_naming_them():
    window = KVCacheGroupSpec(["swa.0", "swa.1", "swa.2"], SlidingWindowSpec(block_size=BLOCK, num_kv_heads=8,
                                                                               head_size=128, dtype=torch.bfloat16,
                                                                               sliding_window=128))
    mixed = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[*full_attention(["l0"]).kv_cache_groups,
                                                                               window])
    with pytest.raises(UnsupportedConfig, match=r"SlidingWindowSpec \(swa.0, swa.1, \.\.\.\)"):
        KVConnectorFactory.create_connector(vllm_config(), KVConnectorRole.SCHEDULER, mixed)
    with pytest.raises(UnsupportedConfig, match="lookahead of 3 tokens"):
        KVConnectorFactory.create_connector(vllm_config(lookahead=3), KVConnectorRole.SCHEDULER, full_attention(["l0"]))


# -- (b) the same decisions as vLLM's NIXL connector in push mode -------------------------------------
@pytest.fixture
def both():
    """vLLM's push scheduler and kvplan's, on the same configuration (two groups: vLLM passes one block
    list per group)."""
    config, kv_cache = vllm_config(), full_attention(["l0", "l1"], ["l2", "l3"])
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
