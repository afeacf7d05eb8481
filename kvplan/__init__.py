"""kvplan: GPU-resident transfer planning for prefill/decode-disaggregated LLM serving.

What a user calls first::

    from kvplan import Batch, Transfer, SideMemory, KVLayout, Entry   # a batch (docs/planning.md)
    from kvplan import plan, Planner, BatchColumns                    # plan it on the device
    from kvplan import plan_destinations, PreallocatedRequest         # the decode's destination lists
    from kvplan import PrefillEndpoint, DecodeEndpoint                # move it (docs/failures.md)
    from kvplan import plan_reference                                 # the oracle it is checked against

Names are imported on first use: ``import kvplan`` alone loads no kernel, so that a program (the
``kvplan`` command) can still choose Triton's interpreter before the first kernel is defined.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "KvplanError": "kvplan.errors",
    "LayoutError": "kvplan.errors",
    "PlanError": "kvplan.errors",
    "InputError": "kvplan.errors",
    "Attention": "kvplan.planner.contract.batch",
    "Batch": "kvplan.planner.contract.batch",
    "Entry": "kvplan.planner.contract.batch",
    "KVLayout": "kvplan.planner.contract.batch",
    "Policy": "kvplan.planner.contract.batch",
    "SideMemory": "kvplan.planner.contract.batch",
    "StateComponent": "kvplan.planner.contract.batch",
    "StateKind": "kvplan.planner.contract.batch",
    "Transfer": "kvplan.planner.contract.batch",
    "Plan": "kvplan.planner.contract.plan",
    "TransferPlan": "kvplan.planner.contract.plan",
    "destination_lists": "kvplan.planner.reference.oracle",
    "plan_reference": "kvplan.planner.reference.oracle",
    "plan": "kvplan.planner.device.eager",
    "Planner": "kvplan.planner.device.planner",
    "PendingPlan": "kvplan.planner.device.pending",
    "BatchColumns": "kvplan.planner.device.columns",
    "PreallocatedRequest": "kvplan.planner.device.destinations",
    "plan_destinations": "kvplan.planner.device.destinations",
    "PrefillEndpoint": "kvplan.transport.prefill",
    "DecodeEndpoint": "kvplan.transport.decode",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvplan' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
