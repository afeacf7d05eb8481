"""``plan(batch)``: plan one :class:`~kvplan.planner.contract.batch.Batch` on the device, in one call.

The convenience form of :class:`kvplan.planner.device.planner.Planner`: it keeps one planner per side
pairing (a small cache keyed by the sides' identity) and plans eagerly into fresh buffers, so
each returned plan stays valid for as long as it is held. A serving loop that plans every step
should hold a :class:`~kvplan.planner.device.planner.Planner` itself (graph replay, reused buffers).

The same code runs on CPU tensors under ``TRITON_INTERPRET=1`` and on CUDA tensors.

Example::

    from kvplan.planner.device.eager import plan
    pending = plan(batch)                    # returns at once; kernels run on the current stream
    ...                                      # the scheduler goes on
    descs, offsets = pending.descriptors()   # waits for the event; raises PlanError on bad input
    result = pending.result()                # the full Plan, as the reference returns it
"""

from __future__ import annotations

from typing import Sequence

import torch

from .pending import PendingPlan
from .planner import Planner
from ..contract.batch import Batch

__all__ = ["PendingPlan", "plan", "planner_for"]

_PLANNERS: dict[tuple, tuple[Batch, Planner]] = {}
_KEPT = 16


def planner_for(batch: Batch, outputs: Sequence[str], block: int) -> Planner:
    """The eager planner of ``batch``'s sides, policy and outputs (made once, then reused)."""
    key = (id(batch.src), tuple(id(d) for d in batch.dsts), batch.policy, batch.validate, tuple(sorted(outputs)), block)
    hit = _PLANNERS.get(key)
    if hit is not None and hit[0].src is batch.src and all(a is b for a, b in zip(hit[0].dsts, batch.dsts)):
        return hit[1]
    planner = Planner(batch.src, batch.dsts, policy=batch.policy, validate=batch.validate, outputs=outputs,
                      graphs=False, block=block)
    if len(_PLANNERS) >= _KEPT:
        _PLANNERS.pop(next(iter(_PLANNERS)))
    _PLANNERS[key] = (batch, planner)
    return planner


def plan(batch: Batch, stream: torch.cuda.Stream | None = None, block: int = 256, prepared: bool = False,
         outputs: Sequence[str] | None = None) -> PendingPlan:
    """Plan ``batch`` with the kernels; nothing here waits for the device.

    Every error is raised when the plan is consumed (``descriptors()``, ``result()``, ...), naming
    the request, before any byte can move. ``prepared=True`` adds NIXL's prepared-list indices
    (direct mode only); ``outputs`` picks the forms explicitly (see :mod:`kvplan.planner.device.planner`).
    """
    if outputs is None:
        outputs = ("descriptors", "prepared") if prepared else ("descriptors",)
    planner = planner_for(batch, outputs, block)
    return planner.plan(batch, stream)
