"""kvplan as an SGLang plugin: SGLang's own ``load_plugins()`` finds kvplan's entry point;
with ``KVPLAN_SGLANG=1`` SGLang's ``get_kv_class`` hands its prefill and decode schedulers kvplan's
manager, sender and receiver for NIXL and Mooncake and keeps its own bootstrap server; without it,
SGLang's classes. Each case runs in a child process of its own (forked from the tests' fork server,
which imports SGLang's modules but never loads plugins): SGLang loads plugins once per process and
its hooks patch the modules of that process."""

import json
import os

import pytest

from kvplan.integrations.sglang.settings import Settings, SettingsError
from tests.isolated import run_isolated
from tests.sglang_real import sglang_module

pytestmark = pytest.mark.sglang


def _probe() -> dict:
    """What SGLang's schedulers ask for, through the very function objects its modules imported,
    once SGLang has loaded its plugins in this process."""
    from tests.sglang_real import _stand_ins

    _stand_ins()
    from sglang.srt.disaggregation import decode, prefill, utils
    from sglang.srt.managers import disagg_service
    from sglang.srt.plugins import load_plugins

    load_plugins()
    out = {}
    for backend in (utils.TransferBackend.NIXL, utils.TransferBackend.MOONCAKE):
        for role in utils.KVClassType:
            for where, module in (("prefill", prefill), ("decode", decode), ("utils", utils),
                                  ("service", disagg_service)):
                cls = module.get_kv_class(backend, role)
                out[f"{backend.value}/{role.value}/{where}"] = f"{cls.__module__}.{cls.__qualname__}"
    return out


def _classes(switch: str | None) -> dict:
    sglang_module("srt.disaggregation.base.conn")  # skips where SGLang is not installed
    env = {k: v for k, v in os.environ.items() if k != "KVPLAN_SGLANG"}
    if switch is not None:
        env["KVPLAN_SGLANG"] = switch
    return run_isolated(_probe, timeout=240, env=env)


def test_the_entry_point_is_in_sglang_s_plugin_group():
    from importlib.metadata import entry_points

    points = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert points.get("kvplan") == "kvplan.integrations.sglang.plugin:register"


def test_kvplan_sglang_1_gives_sglang_s_schedulers_kvplan_s_classes():
    got = _classes("1")
    for backend in ("nixl", "mooncake"):
        for where in ("prefill", "decode", "utils", "service"):
            assert got[f"{backend}/manager/{where}"] == "kvplan.integrations.sglang.adapter.KVManager"
            assert got[f"{backend}/sender/{where}"] == "kvplan.integrations.sglang.adapter.KVSender"
            assert got[f"{backend}/receiver/{where}"] == "kvplan.integrations.sglang.receiver.KVReceiver"
            # SGLang's own bootstrap server and KVArgs stay: its port keeps working
            assert got[f"{backend}/bootstrap_server/{where}"].startswith("sglang.srt.disaggregation.")
            assert got[f"{backend}/kvargs/{where}"] == "sglang.srt.disaggregation.base.conn.KVArgs"


@pytest.mark.parametrize("switch", [None, "0", ""])
def test_without_the_switch_sglang_keeps_its_own_classes(switch):
    got = _classes(switch)
    assert got["nixl/manager/decode"] == "sglang.srt.disaggregation.nixl.conn.NixlKVManager"
    assert got["mooncake/sender/prefill"] == "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender"
    assert not any(name.startswith("kvplan") for name in got.values())


def test_settings_come_from_server_args_then_environment_then_file(tmp_path):
    config = tmp_path / "kvplan.json"
    config.write_text(json.dumps({"mode": "staged", "timeout_s": 5, "engine_settings": {"num_threads": 2}}))
    environ = {"KVPLAN_CONFIG": str(config), "KVPLAN_TIMEOUT_S": "7.5", "KVPLAN_STATE_PARAMS": '[{"window": 128}]'}
    got = Settings.read(None, environ)
    assert (got.mode, got.timeout_s, got.engine_settings, got.state_params) == ("staged", 7.5, {"num_threads": 2},
                                                                               [{"window": 128}])
    assert got.bootstrap == "sglang" and got.host is None  # the defaults: SGLang's bootstrap server, SGLang's host
    assert got.warm_up == {"max_transfers": 16, "max_prompt_len": 8192}
    assert Settings.read(None, {"KVPLAN_WARM_UP": "{}"}).warm_up == {}  # (warms nothing)
    server_args = type("ServerArgs", (), {"kvplan_mode": "direct"})()
    assert Settings.read(server_args, environ).mode == "direct"
    assert got.integrity is False and Settings.read(None, {"KVPLAN_INTEGRITY": "true"}).integrity is True
    assert Settings.read(type("ServerArgs", (), {"kvplan_integrity": True})(), {}).integrity is True


@pytest.mark.parametrize("environ, named", [
    ({"KVPLAN_MODE": "fast"}, "KVPLAN_MODE"),
    ({"KVPLAN_TIMEOUT_S": "0"}, "KVPLAN_TIMEOUT_S"),
    ({"KVPLAN_ENGINE_SETTINGS": "{num_threads: 4}"}, "KVPLAN_ENGINE_SETTINGS"),
    ({"KVPLAN_STATE_PARAMS": '{"window": 4}'}, "KVPLAN_STATE_PARAMS"),
    ({"KVPLAN_BOOTSTRAP": "http"}, "KVPLAN_BOOTSTRAP"),
    ({"KVPLAN_CONFIG": "/nonexistent/kvplan.json"}, "KVPLAN_CONFIG"),
    ({"KVPLAN_WARM_UP": '{"max_transfers": 16}'}, "KVPLAN_WARM_UP"),
    ({"KVPLAN_WARM_UP": '{"max_transfers": 0, "max_prompt_len": 8192}'}, "KVPLAN_WARM_UP"),
    ({"KVPLAN_INTEGRITY": "maybe"}, "KVPLAN_INTEGRITY"),
    ({"KVPLAN_STAGING_MIB": "-1"}, "KVPLAN_STAGING_MIB"),
    ({"KVPLAN_STAGING_MIB": "lots"}, "KVPLAN_STAGING_MIB"),
    ({"KVPLAN_STAGING_SENDERS": "0"}, "KVPLAN_STAGING_SENDERS"),
])
def test_a_setting_that_does_not_parse_is_refused_naming_it(environ, named):
    with pytest.raises(SettingsError, match=named):
        Settings.read(None, environ)


def test_the_staging_buffer_is_on_by_default_on_a_gpu_and_staged_without_one_is_refused():
    """Where ``auto`` would stage (a GPU), a manager gets a 256 MiB buffer unless told otherwise; a CPU gets
    none (the gathers run interpreted there); SGLang's protocol none (its peers have none). Mode ``staged``
    without a buffer is refused naming the setting, before any engine is made, never sent direct."""
    assert Settings.read(None, {}).staging_bytes("cuda", "kvplan") == 256 << 20
    assert Settings.read(None, {}).staging_bytes("cpu", "kvplan") == 0
    assert Settings.read(None, {"KVPLAN_STAGING_MIB": "8"}).staging_bytes("cpu", "kvplan") == 8 << 20
    assert Settings.read(None, {"KVPLAN_STAGING_MIB": "0"}).staging_bytes("cuda", "kvplan") == 0
    assert Settings.read(None, {}).staging_bytes("cuda", "sglang") == 0
    with pytest.raises(SettingsError, match="staging_mib"):
        Settings.read(None, {"KVPLAN_MODE": "staged"}).staging_bytes("cpu", "kvplan")
    with pytest.raises(SettingsError, match="staging_mib"):
        Settings.read(None, {"KVPLAN_MODE": "staged", "KVPLAN_STAGING_MIB": "0"}).staging_bytes("cuda", "kvplan")


def test_an_unknown_key_in_the_config_file_is_refused(tmp_path):
    config = tmp_path / "kvplan.json"
    config.write_text(json.dumps({"mdoe": "staged"}))
    with pytest.raises(SettingsError, match="mdoe"):
        Settings.read(None, {"KVPLAN_CONFIG": str(config)})


def test_the_secret_comes_from_the_file_its_setting_names(tmp_path, monkeypatch):
    """kvplan's SGLang settings pass the control plane's secret (``secret_file``: a server arg,
    ``KVPLAN_SECRET_FILE`` or the config file's key), else ``KVPLAN_SECRET``, else none."""
    monkeypatch.delenv("KVPLAN_SECRET", raising=False)
    monkeypatch.delenv("KVPLAN_SECRET_FILE", raising=False)
    path = tmp_path / "secret"
    path.write_text("the deployment's\n")
    path.chmod(0o600)  # (a secret's file is its owner's alone)
    assert Settings.read(None, {"KVPLAN_SECRET_FILE": str(path)}).secret() == b"the deployment's"
    server_args = type("ServerArgs", (), {"kvplan_secret_file": str(path)})()
    assert Settings.read(server_args, {}).secret() == b"the deployment's"
    assert Settings.read(None, {}).secret() is None
    monkeypatch.setenv("KVPLAN_SECRET", "from the environment")
    assert Settings.read(None, {}).secret() == b"from the environment"


def test_the_opt_out_of_a_secret_is_a_setting_of_its_own_off_by_default(tmp_path):
    """``insecure`` (``KVPLAN_INSECURE``, ``kvplan_insecure``, the config file's key): the only way to run
    kvplan's control plane open (docs/failures.md §10); anything but a switch word is refused."""
    assert Settings.read(None, {}).insecure is False
    assert Settings.read(None, {"KVPLAN_INSECURE": "1"}).insecure is True
    assert Settings.read(type("ServerArgs", (), {"kvplan_insecure": True})(), {}).insecure is True
    config = tmp_path / "kvplan.json"
    config.write_text(json.dumps({"insecure": True}))
    assert Settings.read(None, {"KVPLAN_CONFIG": str(config)}).insecure is True
    with pytest.raises(SettingsError, match="KVPLAN_INSECURE: expected true or false"):
        Settings.read(None, {"KVPLAN_INSECURE": "perhaps"})


def test_a_switch_value_that_is_no_switch_stops_the_process_in_one_line(monkeypatch):
    """SGLang logs a plugin's exception and runs on without it: a typo in the switch must stop the process
    instead (SystemExit is no Exception), naming the variable."""
    from kvplan.integrations.sglang import plugin

    monkeypatch.setenv("KVPLAN_SGLANG", "maybe")
    with pytest.raises(SystemExit, match="^kvplan: KVPLAN_SGLANG='maybe': not a switch"):
        plugin.register()
    for value, on in (("1", True), ("yes", True), ("on", True), ("0", False), ("off", False), ("", False)):
        assert plugin.enabled({"KVPLAN_SGLANG": value}) is on
    assert plugin.enabled({}) is False
