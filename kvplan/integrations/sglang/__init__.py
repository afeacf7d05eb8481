"""kvplan inside SGLang.

* :func:`side_from_kv_args`: SGLang's ``KVArgs`` as a kvplan :class:`~kvplan.planner.contract.batch.SideMemory`,
  state components included (:func:`state_from_kv_args`).
* :mod:`.adapter`: ``KVManager``, ``KVSender`` and ``KVReceiver`` under SGLang's base classes
  (imported on first use: they need SGLang installed).

Example::

    from kvplan.integrations.sglang import KVManager, KVSender, side_from_kv_args

    side = side_from_kv_args(kv_args, mla=False, attn_tp_size=4, req_to_token=req_to_token)
    mgr = KVManager(kv_args, DisaggregationMode.PREFILL, server_args)
"""

from typing import Any

from .kv_args import side_from_kv_args, state_from_kv_args

__all__ = ["KVManager", "KVReceiver", "KVSender", "side_from_kv_args", "state_from_kv_args"]


def __getattr__(name: str) -> Any:
    if name in ("KVManager", "KVReceiver", "KVSender", "TransferFailed"):
        from . import adapter

        return getattr(adapter, name)
    raise AttributeError(name)
