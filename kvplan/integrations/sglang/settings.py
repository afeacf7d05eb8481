"""kvplan's own settings inside SGLang: one table, read from the server args, the environment or a file.

SGLang's ``ServerArgs`` has no field for kvplan, so a deployment that switches kvplan on with the
plugin (``KVPLAN_SGLANG=1``, :mod:`.plugin`) gives kvplan's settings as ``KVPLAN_*`` environment
variables, or in a JSON file named by ``KVPLAN_CONFIG``. For each setting the first of these wins:

1. an attribute ``kvplan_<name>`` of the server args (code that builds the managers itself, tests);
2. the environment variable ``KVPLAN_<NAME>``;
3. the key ``<name>`` of the JSON object in the file ``KVPLAN_CONFIG``;
4. the default below.

============== ======================= =========== ==================================================
name           environment             default     meaning
============== ======================= =========== ==================================================
mode           ``KVPLAN_MODE``         ``auto``    ``auto``, ``direct``, ``prepared`` or ``staged``
timeout_s      ``KVPLAN_TIMEOUT_S``    ``30``      deadline of every wait of a transfer, in seconds
engine         ``KVPLAN_ENGINE``       (backend)   ``nixl``, ``mooncake`` or ``ipc`` (every prefill
                                                   and decode on one host: the GPU writes the
                                                   decode's pages itself); default: SGLang's
                                                   ``--disaggregation-transfer-backend``
engine_settings ``KVPLAN_ENGINE_SETTINGS`` ``{}``  JSON object for the engine (NIXL: ``num_threads``,
                                                   ``progress_thread``; Mooncake: ``protocol`` and
                                                   ``device_name``, else SGLang's own
                                                   (:mod:`.mooncake_settings`), and its TCP settings)
state_params   ``KVPLAN_STATE_PARAMS`` ``[]``      JSON list, one object per state component: what
                                                   ``KVArgs`` lacks (``window``, ``ring_size``, ...)
protocol       ``KVPLAN_PROTOCOL``     ``kvplan``  ``kvplan`` (both sides kvplan) or ``sglang``
                                                   (kvplan on one side, SGLang's own on the other)
bootstrap      ``KVPLAN_BOOTSTRAP``    ``sglang``  how a decode finds a prefill rank (kvplan's
                                                   protocol): ``sglang``, through SGLang's bootstrap
                                                   server; ``direct``, kvplan's listener *is* the
                                                   bootstrap port (no SGLang bootstrap server runs)
host           ``KVPLAN_HOST``         (SGLang's)  the address kvplan binds and advertises; default:
                                                   the node's address as SGLang finds it
decode_lens    ``KVPLAN_DECODE_LENS``  none        JSON: an SGLang decode's buffer lengths, for a
                                                   kvplan prefill serving it (``protocol=sglang``)
warm_up        ``KVPLAN_WARM_UP``      see meaning JSON object: the batches a prefill rank's planner is
                                                   made ready for as each decode pairs
                                                   (``PrefillEndpoint.warm_up``): default
                                                   ``{"max_transfers": 16, "max_prompt_len": 8192}``;
                                                   ``{}`` warms nothing
secret_file    ``KVPLAN_SECRET_FILE``  none        a file holding the control plane's shared secret
                                                   (docs/failures.md §10); without it,
                                                   ``KVPLAN_SECRET`` if set, else on loopback this
                                                   user's loopback secret; off loopback a manager
                                                   without a secret does not start
insecure       ``KVPLAN_INSECURE``     ``false``   ``true``: without a secret the control plane runs
                                                   open (anyone who reaches a port can pair and be
                                                   sent KV); logged and counted in the metrics
integrity      ``KVPLAN_INTEGRITY``    ``false``   a decode asks its prefills for each request's
                                                   checksum and completes a request only once its
                                                   bytes agree (docs/failures.md §7): ``true``/``false``
staging_mib    ``KVPLAN_STAGING_MIB``  see meaning the staging buffer each manager allocates on its GPU
                                                   when it is made, in MiB (kvplan's protocol): what
                                                   ``auto`` and ``staged`` send through; default 256
                                                   on a GPU, 0 (none: direct only) on a CPU
staging_senders ``KVPLAN_STAGING_SENDERS`` ``4``   a decode's buffer is shared by this many prefill
                                                   ranks, each its own share; one more is refused
stats_s        ``KVPLAN_STATS_S``      ``60``      every this many seconds a manager logs kvplan's
                                                   counters (one INFO line, at a poll); 0: never
aux_mirror     ``KVPLAN_AUX_MIRROR``   ``auto``    SGLang's aux buffers in host memory beside device
                                                   pools get a device copy that kvplan moves
                                                   (:mod:`.aux_mirror`): ``auto``; ``always`` (on a
                                                   CPU too); ``never`` (such a manager is refused)
============== ======================= =========== ==================================================

A value that does not parse is refused with :class:`SettingsError`, naming the setting and where it
came from; so is an unknown key in the file.

Example::

    # export KVPLAN_MODE=staged KVPLAN_ENGINE_SETTINGS='{"num_threads": 4}'
    settings = Settings.read(server_args)
    settings.mode, settings.engine_settings       # ('staged', {'num_threads': 4})
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from ... import env
from ...errors import KvplanError

__all__ = ["MODES", "PROTOCOLS", "BOOTSTRAPS", "Settings", "SettingsError"]

MODES = ("auto", "direct", "prepared", "staged")
PROTOCOLS = ("kvplan", "sglang")
BOOTSTRAPS = ("sglang", "direct")
WARM_UP = {"max_transfers": 16, "max_prompt_len": 8192}
DEFAULT_STAGING_MIB = 256
CONFIG_VARIABLE = "KVPLAN_CONFIG"


class SettingsError(KvplanError, ValueError):
    """A kvplan setting that does not parse or is out of range; names it and where it came from."""


@dataclass(frozen=True)
class Settings:
    """kvplan's settings for one SGLang manager (see the module's table)."""

    mode: str = "auto"
    timeout_s: float = 30.0
    engine: str | None = None
    engine_settings: dict = field(default_factory=dict)
    state_params: list = field(default_factory=list)
    protocol: str = "kvplan"
    bootstrap: str = "sglang"
    host: str | None = None
    decode_lens: Any = None
    warm_up: dict = field(default_factory=lambda: dict(WARM_UP))
    secret_file: str | None = None
    insecure: bool = False
    integrity: bool = False
    staging_mib: int | None = None  # None: DEFAULT_STAGING_MIB on a GPU, none on a CPU
    staging_senders: int = 4
    stats_s: int = 60
    aux_mirror: str = "auto"

    def staging_bytes(self, device_type: str, protocol: str) -> int:
        """The staging buffer's size for a manager on a device of this type (0: none; none with SGLang's
        protocol, whose peers have none). Mode ``staged`` without one is refused, naming the setting."""
        mib = 0 if protocol != "kvplan" else self.staging_mib if self.staging_mib is not None else \
            DEFAULT_STAGING_MIB if device_type == "cuda" else 0
        if self.mode == "staged" and not mib:
            raise SettingsError(f"mode staged needs a staging buffer and this manager has none (staging_mib "
                                f"{self.staging_mib}, a {device_type} device, protocol {protocol}): set "
                                "staging_mib, or mode auto")
        return mib << 20

    def secret(self) -> bytes | None:
        """The control plane's shared secret as configured: the ``secret_file``'s, else ``KVPLAN_SECRET``'s or
        ``KVPLAN_SECRET_FILE``'s, else none (the channels then take the loopback secret, or refuse to start
        off loopback unless ``insecure``: :func:`kvplan.transport.auth.channel_secret`)."""
        from ...transport.auth import configured_secret

        return configured_secret(self.secret_file)

    def channel_security(self, host: str | None = None) -> dict[str, Any]:
        """The control channels' ``secret`` and ``insecure`` arguments, as configured; with ``host``, checked first
        for a channel there (:func:`kvplan.transport.auth.channel_secret`: off loopback with neither, a
        :class:`~kvplan.errors.SettingError` that says what to set)."""
        from ...transport.auth import channel_secret

        arguments = {"secret": self.secret(), "insecure": self.insecure}
        if host is not None:
            channel_secret(host, **arguments)
        return arguments

    @classmethod
    def read(cls, server_args: Any = None, environ: Mapping[str, str] | None = None) -> "Settings":
        """The settings in force: server args, then ``KVPLAN_*``, then the ``KVPLAN_CONFIG`` file, then
        the defaults."""
        environ = os.environ if environ is None else environ
        from_file = _config_file(environ)
        values: dict[str, Any] = {}
        for f in fields(cls):
            attr = getattr(server_args, f"kvplan_{f.name}", None) if server_args is not None else None
            variable = f"KVPLAN_{f.name.upper()}"
            if attr is not None:
                values[f.name] = _parse(f.name, attr, f"server arg kvplan_{f.name}", text=False)
            elif environ.get(variable, "") != "":
                values[f.name] = _parse(f.name, environ[variable], variable, text=True)
            elif f.name in from_file:
                values[f.name] = _parse(f.name, from_file[f.name], f"{environ[CONFIG_VARIABLE]}: {f.name}", text=False)
        return cls(**values)


_JSON_SETTINGS = {"engine_settings": dict, "state_params": list, "decode_lens": (dict, list), "warm_up": dict}
_BOOLS = ("integrity", "insecure")
_COUNTS = {"staging_mib": 0, "staging_senders": 1, "stats_s": 0}  # whole numbers, each at least this
# the switch words of every KVPLAN_* flag (kvplan.env); here an empty value is no switch
_TRUE, _FALSE = env.FLAG_ON, tuple(word for word in env.FLAG_OFF if word)
_CHOICES = {"mode": MODES, "protocol": PROTOCOLS, "bootstrap": BOOTSTRAPS, "engine": ("nixl", "mooncake", "ipc"),
            "aux_mirror": ("auto", "always", "never")}


def _parse(name: str, value: Any, where: str, text: bool) -> Any:
    if name in _JSON_SETTINGS:
        if text:
            try:
                value = json.loads(value)
            except ValueError as err:
                raise SettingsError(f"{where}: not JSON ({err}): {value[:80]!r}") from None
        if not isinstance(value, _JSON_SETTINGS[name]):
            raise SettingsError(f"{where}: expected a JSON {'list' if name == 'state_params' else 'object'}, "
                                f"got {type(value).__name__}")
        if name == "warm_up" and value and (set(value) != set(WARM_UP) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value.values())):
            raise SettingsError(f"{where}: expected {{}} or positive integers for exactly {sorted(WARM_UP)}, got {value}")
        return dict(value) if isinstance(value, dict) else value
    if name in _BOOLS:
        if isinstance(value, bool):
            return value
        text_value = str(value).strip().lower()
        if text_value not in _TRUE + _FALSE:
            raise SettingsError(f"{where}: expected true or false, got {value!r}")
        return text_value in _TRUE
    if name in _COUNTS:
        least = _COUNTS[name]
        try:
            count = int(str(value).strip()) if not isinstance(value, bool) else None
        except ValueError:
            count = None
        if count is None or count < least or count > 1 << 16:
            raise SettingsError(f"{where}: expected a whole number of at least {least}, got {value!r}")
        return count
    if name == "timeout_s":
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            raise SettingsError(f"{where}: not a number of seconds: {value!r}") from None
        if not seconds > 0:
            raise SettingsError(f"{where}: a deadline must be positive, got {seconds}")
        return seconds
    value = str(value).strip()
    if name in _CHOICES and value not in _CHOICES[name]:
        raise SettingsError(f"{where}: {value!r} is not one of {list(_CHOICES[name])}")
    return value


def _config_file(environ: Mapping[str, str]) -> dict:
    path = environ.get(CONFIG_VARIABLE, "")
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as err:
        raise SettingsError(f"{CONFIG_VARIABLE}={path}: cannot be read: {err.strerror}") from None
    except ValueError as err:
        raise SettingsError(f"{CONFIG_VARIABLE}={path}: not JSON: {err}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"{CONFIG_VARIABLE}={path}: expected a JSON object of settings")
    unknown = sorted(set(data) - {f.name for f in fields(Settings)})
    if unknown:
        raise SettingsError(f"{CONFIG_VARIABLE}={path}: unknown settings {unknown}; known: "
                            f"{[f.name for f in fields(Settings)]}")
    return data
