"""kvplan: GPU-resident transfer planning for prefill/decode-disaggregated LLM serving.

The public entry points::

    from kvplan import Batch, Transfer, SideMemory, KVLayout, Entry, plan_reference
"""

from .errors import KvplanError, LayoutError, PlanError
from .planner.model import (
    Attention,
    Batch,
    Entry,
    KVLayout,
    Policy,
    SideMemory,
    StateComponent,
    StateKind,
    Transfer,
)
from .planner.plan import Plan, TransferPlan
from .planner.reference import destination_lists, plan_reference

__version__ = "0.1.0"

__all__ = [
    "Attention",
    "Batch",
    "Entry",
    "KVLayout",
    "KvplanError",
    "LayoutError",
    "Plan",
    "PlanError",
    "Policy",
    "SideMemory",
    "StateComponent",
    "StateKind",
    "Transfer",
    "TransferPlan",
    "destination_lists",
    "plan_reference",
]
