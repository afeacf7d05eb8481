"""kvplan as an SGLang plugin: one switch, ``KVPLAN_SGLANG=1``.

kvplan's package registers :func:`register` under SGLang's general-plugin entry point group
``sglang.srt.plugins``; SGLang 0.5.23 calls it through ``load_plugins()`` in every scheduler
process. Unless ``KVPLAN_SGLANG`` is ``1`` (or ``true``, ``yes``, ``on``) it does nothing, and SGLang
runs exactly as without kvplan; any other word than those and ``0``/``false``/``no``/``off`` stops the
process with one line naming the variable (a typo must not run SGLang without kvplan unnoticed). When it is set, it hooks SGLang's
``sglang.srt.disaggregation.utils.get_kv_class`` (an AROUND hook of SGLang's ``HookRegistry``):
for ``--disaggregation-transfer-backend nixl`` and ``mooncake`` the prefill and decode schedulers
get kvplan's :class:`~.adapter.KVManager`, :class:`~.adapter.KVSender` and
:class:`~.receiver.KVReceiver`; the ``KVArgs`` container and the bootstrap server stay SGLang's, so
SGLang's own bootstrap server keeps serving its port. kvplan's settings come from ``KVPLAN_*``
variables (:mod:`.settings`).

Example (what a deployment does, docs/sglang.md; nothing to import)::

    pip install "dist/kvplan-0.1.0-py3-none-any.whl[nixl]"
    KVPLAN_SGLANG=1 python -m sglang.launch_server --disaggregation-mode prefill \\
        --disaggregation-transfer-backend nixl ...
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from ... import env
from ...errors import SettingError

__all__ = ["SWITCH", "enabled", "kv_class", "register"]

log = logging.getLogger(__name__)

SWITCH = "KVPLAN_SGLANG"
TARGET = "sglang.srt.disaggregation.utils.get_kv_class"
BACKENDS = ("nixl", "mooncake")  # the transfer backends kvplan stands in for


def enabled(environ: Any = None) -> bool:
    """Whether ``KVPLAN_SGLANG`` switches kvplan on (:class:`~kvplan.errors.SettingError` for a value that
    is no switch)."""
    value = (os.environ if environ is None else environ).get(SWITCH)
    return env.flag(SWITCH, None if value is None else str(value))


def kv_class(original: Callable[..., Any], transfer_backend: Any, class_type: Any) -> Any:
    """SGLang's ``get_kv_class`` with kvplan's manager, sender and receiver for NIXL and Mooncake."""
    from sglang.srt.disaggregation.utils import KVClassType

    backend = str(getattr(transfer_backend, "value", transfer_backend))
    roles = {KVClassType.MANAGER: "KVManager", KVClassType.SENDER: "KVSender", KVClassType.RECEIVER: "KVReceiver"}
    if backend in BACKENDS and class_type in roles:
        from . import adapter

        return getattr(adapter, roles[class_type])
    return original(transfer_backend, class_type)


def register() -> None:
    """SGLang's entry point: hook ``get_kv_class`` when ``KVPLAN_SGLANG`` is set, else nothing. A value that is
    no switch stops the process with one line: SGLang logs a plugin's exception and runs on without it, and
    a typo must not leave a deployment running SGLang's own transfer unnoticed."""
    try:
        on = enabled()
    except SettingError as err:
        log.error("%s", err)
        raise SystemExit(f"kvplan: {err}") from None
    if not on:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, kv_class, HookType.AROUND)
    log.info("kvplan moves SGLang's KV for the transfer backends %s (%s is set)", list(BACKENDS), SWITCH)
