"""The Mooncake engine's settings inside SGLang, taken from the deployment's own.

SGLang's Mooncake backend reads its transport from ``MOONCAKE_PROTOCOL`` (``rdma`` when unset; ``tcp``
where ``MC_FORCE_TCP=1``) and its NICs from ``--disaggregation-ib-device`` (a device list, or a JSON
file mapping each GPU to its devices). kvplan's adapter takes the same, so that a deployment tuned for
SGLang's backend moves over the same transport with kvplan: before, kvplan's Mooncake engine ran over
TCP whatever the deployment said, a silent slowdown on every RDMA cluster. kvplan's own
``engine_settings`` (``KVPLAN_ENGINE_SETTINGS``) win over both. A transport the installed Mooncake
cannot start (RDMA on a machine without its NICs, or the CPU wheel's TCP-only build) refuses the
manager with that reason and the setting it came from, never a silent fallback.

Example::

    settings, where = mooncake_settings(server_args, {}, host="10.0.0.3", gpu_id=0)
    # ({'local_hostname': '10.0.0.3', 'protocol': 'rdma', 'device_name': 'mlx5_0'},
    #  "protocol from MOONCAKE_PROTOCOL='rdma' (SGLang's); devices from --disaggregation-ib-device")
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

from .node import server_arg

__all__ = ["mooncake_settings"]

log = logging.getLogger(__name__)


def _devices_for_gpu(ib_device: str | None, gpu_id: int) -> str:
    """The NICs ``--disaggregation-ib-device`` names for GPU ``gpu_id``, as SGLang's backend reads them."""
    if not ib_device or not str(ib_device).strip():
        return ""
    try:
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import get_ib_devices_for_gpu
    except ImportError:  # (outside SGLang: a plain device list is the whole setting)
        return str(ib_device).strip()
    return get_ib_devices_for_gpu(str(ib_device), gpu_id) or ""


def mooncake_settings(server_args: Any, engine_settings: Mapping[str, Any], host: str, gpu_id: int,
                      environ: Mapping[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """The Mooncake engine's settings for one SGLang rank, and a sentence saying where its transport came
    from (for the log line at start and a refusal's message)."""
    environ = os.environ if environ is None else environ
    settings = dict(engine_settings)
    settings.setdefault("local_hostname", host)  # (peers reach its segment at this rank's address)
    if "protocol" in settings:
        where = "protocol from kvplan's engine_settings"
    elif environ.get("MC_FORCE_TCP") == "1":
        settings["protocol"], where = "tcp", "protocol tcp from MC_FORCE_TCP=1"
    else:
        given = environ.get("MOONCAKE_PROTOCOL", "")
        settings["protocol"] = given or "rdma"
        where = f"protocol from MOONCAKE_PROTOCOL={settings['protocol']!r}{'' if given else ' (unset: SGLang defaults to rdma)'}"
    if "device_name" not in settings and settings["protocol"] not in ("tcp", "nvlink_intra"):
        ib_device = server_arg(server_args, "disaggregation_ib_device", None)
        settings["device_name"] = _devices_for_gpu(ib_device, gpu_id)
        if settings["device_name"]:
            where += f"; devices {settings['device_name']!r} from --disaggregation-ib-device"
    return settings, where
