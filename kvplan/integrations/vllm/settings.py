"""The connector's settings, from ``kv_connector_extra_config`` (each refused, naming it, when it is wrong).

=============== ============================ ======================================================
key             default                      meaning
=============== ============================ ======================================================
host            vLLM's ``get_ip()``          the address this engine's workers listen at (decodes connect)
port            17500                        worker rank ``r`` listens at ``port + r``
engine          ``"nixl"``                   the transfer engine: ``"nixl"``, ``"mooncake"`` or ``"ipc"`` (one host)
engine_settings ``{}``                       the engine's own settings (docs/engines.md), e.g. Mooncake's
                                             ``{"protocol": "rdma", "device_name": "mlx5_0"}``
timeout_s       120                          how long a transfer may take from the decode's publication:
                                             past it the decode reports the load failed, and a prefill
                                             frees blocks its decode never asked for
max_requests    vLLM's ``max_num_seqs``      requests in flight per worker and direction (planning rows; more wait)
mode            ``"auto"``                   how a prefill writes: ``"direct"`` (one write per run of
                                             blocks that are neighbours on both sides), ``"prepared"``
                                             (NIXL prepared lists, one descriptor per layer x block, as
                                             vLLM's NIXL connector posts), ``"staged"`` (gathered into a
                                             staging buffer, written in a few large writes, scattered on
                                             the decode's GPU), ``"auto"`` (staged where both sides have
                                             staging buffers on a GPU and the blocks are small, else direct)
staging_mib     256                          each staging buffer (a prefill's; a decode's per prefill rank
                                             it receives from), on the KV's GPU; 0: none (writes go direct)
warm_up         ``{"max_transfers": 16,      the batches each pairing is made ready for before its first
                "max_prompt_len": 8192}``    (planners captured, copy kernels compiled, connection opened:
                                             the endpoints' ``warm_up``); ``{}``: none
secret_file     none                         a file holding the control plane's shared secret (docs/failures.md
                                             §10; never the secret itself: vLLM logs this config); without it
                                             ``KVPLAN_SECRET`` or ``KVPLAN_SECRET_FILE``, else on loopback this
                                             user's loopback secret; off loopback a worker without a secret
                                             does not start
insecure        ``false``                    ``true``: without a secret the control plane runs open (anyone who
                                             reaches a port can pair and be sent KV); logged and counted
integrity       ``false``                    a decode asks each prefill for a checksum of every request's
                                             bytes (keyed with the secret where one is set) and reports the
                                             request finished only once they agree (docs/failures.md §7);
                                             not with ``mode`` ``"prepared"``
layout          ``"LBHNC"``                  the KV cache layout the connector asks vLLM for (models with KV
                                             heads): ``"LBHNC"`` (each head's tokens of a block in a row, as
                                             vLLM's NIXL connector asks; the sides may differ in TP size) or
                                             ``"LBNHC"`` (each token's heads side by side; the sides may also
                                             differ in block size)
=============== ============================ ======================================================

Example::

    settings = Settings.parse({"host": "10.0.0.3", "engine": "mooncake",
                               "engine_settings": {"protocol": "rdma"}}, tp_size=8, max_num_seqs=256)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...errors import SettingError
from ...transport.engines import check_settings
from .scheduler import ListenAddress, UnsupportedConfig

__all__ = ["DEFAULT_PORT", "ENGINES", "LAYOUTS", "MODES", "Settings", "layout_setting"]

DEFAULT_PORT = 17500
DEFAULT_TIMEOUT_S = 120.0
ENGINES = ("nixl", "mooncake", "ipc")
_KEYS = ("host", "port", "engine", "engine_settings", "timeout_s", "max_requests", "mode", "staging_mib", "warm_up",
         "layout", "secret_file", "insecure", "integrity")
WARM_UP = {"max_transfers": 16, "max_prompt_len": 8192}
MODES = ("auto", "direct", "prepared", "staged")
LAYOUTS = ("LBHNC", "LBNHC")
DEFAULT_STAGING_MIB = 256


@dataclass(frozen=True)
class Settings:
    """What ``kv_connector_extra_config`` says (see the module docstring)."""

    listen: ListenAddress
    engine: str = "nixl"
    engine_settings: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_requests: int = 256
    mode: str = "auto"
    staging_mib: int = DEFAULT_STAGING_MIB
    warm_up: dict[str, int] = field(default_factory=lambda: dict(WARM_UP))
    layout: str = LAYOUTS[0]
    secret_file: str | None = None
    integrity: bool = False
    insecure: bool = False

    def secret(self) -> bytes | None:
        """The control plane's shared secret as configured: the ``secret_file``'s, else the environment's, else
        none (:func:`kvplan.transport.auth.configured_secret`)."""
        from ...transport.auth import configured_secret

        return configured_secret(self.secret_file)

    @classmethod
    def parse(cls, extra: dict[str, Any] | None, tp_size: int, max_num_seqs: int = 256) -> "Settings":
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_KEYS))
        if unknown:
            raise UnsupportedConfig(f"kv_connector_extra_config: unknown keys {unknown}; kvplan takes {list(_KEYS)}")
        port = extra.get("port", DEFAULT_PORT)
        if not _is_int(port) or not 0 < port <= 65536 - tp_size:
            raise UnsupportedConfig(f"kv_connector_extra_config: port {port!r} is not a port number from which "
                                    f"{tp_size} ranks' ports (port + rank) fit")
        host = extra.get("host")
        if host is None:
            from vllm.utils.network_utils import get_ip

            host = get_ip()  # vLLM's own choice of this node's address (VLLM_HOST_IP first)
        if not isinstance(host, str) or not host:
            raise UnsupportedConfig(f"kv_connector_extra_config: host {host!r} is not an address")
        engine = extra.get("engine", "nixl")
        if engine not in ENGINES:
            raise UnsupportedConfig(f"kv_connector_extra_config: engine {engine!r}; kvplan's connector moves through "
                                    f"{list(ENGINES)}")
        engine_settings = extra.get("engine_settings", {})
        if not isinstance(engine_settings, dict):
            raise UnsupportedConfig(f"kv_connector_extra_config: engine_settings {engine_settings!r} is not a mapping")
        try:
            check_settings(engine, engine_settings, where="kv_connector_extra_config: engine_settings")
        except SettingError as err:
            raise UnsupportedConfig(str(err)) from None
        timeout = extra.get("timeout_s", DEFAULT_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e6:
            raise UnsupportedConfig(f"kv_connector_extra_config: timeout_s {timeout!r} is not a positive number of "
                                    "seconds")
        rows = extra.get("max_requests", max_num_seqs)
        if not _is_int(rows) or rows < 1:
            raise UnsupportedConfig(f"kv_connector_extra_config: max_requests {rows!r} is not a positive count")
        mode = extra.get("mode", "auto")
        if mode not in MODES or (mode == "prepared" and engine != "nixl"):
            raise UnsupportedConfig(f"kv_connector_extra_config: mode {mode!r}; kvplan's connector writes {list(MODES)} "
                                    "('prepared' through NIXL only)")
        staging = extra.get("staging_mib", DEFAULT_STAGING_MIB)
        if not _is_int(staging) or not 0 <= staging <= 1 << 16:
            raise UnsupportedConfig(f"kv_connector_extra_config: staging_mib {staging!r} is not a size in MiB (0: none)")
        warm = extra.get("warm_up", WARM_UP)
        if not isinstance(warm, dict) or (warm and (set(warm) != set(WARM_UP)
                                                    or not all(_is_int(v) and v > 0 for v in warm.values()))):
            raise UnsupportedConfig(f"kv_connector_extra_config: warm_up {warm!r} is not {{}} or "
                                    f"{{'max_transfers': N, 'max_prompt_len': N}} with positive counts")
        secret_file = extra.get("secret_file")
        if secret_file is not None and (not isinstance(secret_file, str) or not secret_file):
            raise UnsupportedConfig(f"kv_connector_extra_config: secret_file {secret_file!r} is not a file's path")
        integrity, insecure = extra.get("integrity", False), extra.get("insecure", False)
        if not isinstance(integrity, bool):
            raise UnsupportedConfig(f"kv_connector_extra_config: integrity {integrity!r} is not true or false")
        if not isinstance(insecure, bool):
            raise UnsupportedConfig(f"kv_connector_extra_config: insecure {insecure!r} is not true or false")
        if integrity and mode == "prepared":
            raise UnsupportedConfig("kv_connector_extra_config: integrity needs every byte written as planned, which "
                                    "mode 'prepared' (NIXL's own lists) does not report; choose another mode")
        return cls(ListenAddress(host, port), engine, dict(engine_settings), float(timeout), rows, mode, staging,
                   dict(warm), layout_setting(extra), secret_file, integrity, insecure)


def layout_setting(extra: dict[str, Any] | None) -> str:
    """The ``layout`` of ``kv_connector_extra_config`` (refused, naming it, where it is not one of :data:`LAYOUTS`)."""
    layout = (extra or {}).get("layout", LAYOUTS[0])
    if layout not in LAYOUTS:
        raise UnsupportedConfig(f"kv_connector_extra_config: layout {layout!r}; kvplan's connector asks vLLM for "
                                f"one of {list(LAYOUTS)}")
    return layout


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
