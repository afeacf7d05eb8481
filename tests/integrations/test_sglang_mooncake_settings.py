"""Inside SGLang, kvplan's Mooncake engine takes the deployment's transport and NICs as SGLang's own
Mooncake backend does (``MOONCAKE_PROTOCOL``, ``MC_FORCE_TCP``, ``--disaggregation-ib-device``), where before
it ran over TCP whatever the deployment said; kvplan's own ``engine_settings`` win."""

import json
import types

import pytest

from kvplan.integrations.sglang.mooncake_settings import mooncake_settings

ARGS = types.SimpleNamespace(disaggregation_ib_device="mlx5_0,mlx5_1")


def test_unset_the_transport_is_sglang_s_default_rdma_over_the_named_nics():
    settings, where = mooncake_settings(ARGS, {}, "10.0.0.3", 0, environ={})
    assert settings == {"local_hostname": "10.0.0.3", "protocol": "rdma", "device_name": "mlx5_0,mlx5_1"}
    assert "MOONCAKE_PROTOCOL='rdma' (unset: SGLang defaults to rdma)" in where and "--disaggregation-ib-device" in where


def test_mooncake_protocol_and_mc_force_tcp_are_honoured():
    assert mooncake_settings(ARGS, {}, "h", 0, environ={"MOONCAKE_PROTOCOL": "efa"})[0]["protocol"] == "efa"
    settings, where = mooncake_settings(ARGS, {}, "h", 0, environ={"MOONCAKE_PROTOCOL": "rdma", "MC_FORCE_TCP": "1"})
    assert settings == {"local_hostname": "h", "protocol": "tcp"} and "MC_FORCE_TCP=1" in where


def test_kvplan_s_own_engine_settings_win():
    settings, where = mooncake_settings(ARGS, {"protocol": "tcp", "lanes": 8, "local_hostname": "h2"}, "h", 0,
                                        environ={"MOONCAKE_PROTOCOL": "rdma"})
    assert settings == {"protocol": "tcp", "lanes": 8, "local_hostname": "h2"} and "engine_settings" in where


def test_a_per_gpu_device_file_gives_each_rank_its_own_nics(tmp_path):
    pytest.importorskip("sglang.srt.distributed.device_communicators.mooncake_transfer_engine")
    mapping = tmp_path / "ib.json"
    mapping.write_text(json.dumps({"0": "mlx5_0", "1": "mlx5_1,mlx5_2"}))
    args = types.SimpleNamespace(disaggregation_ib_device=str(mapping))
    assert mooncake_settings(args, {}, "h", 1, environ={})[0]["device_name"] == "mlx5_1,mlx5_2"
    assert mooncake_settings(args, {}, "h", 0, environ={})[0]["device_name"] == "mlx5_0"


@pytest.mark.engines
def test_the_manager_s_mooncake_engine_runs_the_deployment_s_transport(monkeypatch):
    """SGLang's own objects: a prefill manager over Mooncake with ``MOONCAKE_PROTOCOL=rdma`` hands Mooncake
    rdma (on a machine without RDMA NICs Mooncake itself falls back to TCP, as under SGLang's backend); with
    kvplan's engine_settings saying tcp, tcp."""
    pytest.importorskip("mooncake.engine")
    from tests.integrations import sglang_sides
    from tests.ports import free_port
    from tests.sglang_real import sglang_module

    utils, base = sglang_module("srt.disaggregation.utils"), sglang_module("srt.disaggregation.base.conn")
    from kvplan.integrations.sglang.adapter import KVManager
    kv, aux = sglang_sides.pools(1)
    for given, want in (({}, "rdma"), ({"protocol": "tcp"}, "tcp")):
        monkeypatch.setenv("MOONCAKE_PROTOCOL", "rdma")
        server_args = types.SimpleNamespace(disaggregation_transfer_backend="mooncake", disaggregation_bootstrap_port=free_port(),
                                            kvplan_engine_settings=given, kvplan_bootstrap="direct", kvplan_host="127.0.0.1",
                                            host="127.0.0.1", max_running_requests=1, context_length=64)
        mgr = KVManager(sglang_sides.kv_args_of(base, kv, aux), utils.DisaggregationMode.PREFILL, server_args)
        try:
            assert mgr.engine._protocol == want
        finally:
            mgr.close()
