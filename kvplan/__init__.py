"""kvplan: GPU-resident transfer planning for prefill/decode-disaggregated LLM serving.

The public entry points::

    from kvplan import Batch, Transfer, SideMemory, KVLayout, Entry, plan_reference

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
    "Attention": "kvplan.planner.model",
    "Batch": "kvplan.planner.model",
    "Entry": "kvplan.planner.model",
    "KVLayout": "kvplan.planner.model",
    "Policy": "kvplan.planner.model",
    "SideMemory": "kvplan.planner.model",
    "StateComponent": "kvplan.planner.model",
    "StateKind": "kvplan.planner.model",
    "Transfer": "kvplan.planner.model",
    "Plan": "kvplan.planner.plan",
    "TransferPlan": "kvplan.planner.plan",
    "destination_lists": "kvplan.planner.reference",
    "plan_reference": "kvplan.planner.reference",
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
