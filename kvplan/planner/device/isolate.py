"""One bad request fails alone: every request of a batch that the rules refuse, and a plan of the rest.

By default kvplan refuses a batch whole: when any request is bad, nothing of the batch is planned or
sent. An integrator that prefers per-request failure (SGLang fails one request and goes on) asks
for it explicitly with :func:`plan_each`. The good batch plans on the device as usual; only when it
does not are the transfers checked one by one on the host by the shared rules, and every request
with a refused transfer is left out (all of its transfers: its lists are one unit). Two requests
that claim one destination item (planning.md §6.1) are both left out.

Example::

    pending, refused = plan_each(batch)     # refused: {request: PlanError}, each naming its request
    descs, offsets = pending.descriptors()  # the plan of every other request
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterable

from ...errors import PlanError
from ..contract.claims import Claims, overlaps
from .pending import PendingPlan
from ..contract.batch import Batch
from ..reference.transfer_lists import transfer_lists

__all__ = ["plan_each", "refused_requests", "without"]


def refused_requests(batch: Batch) -> dict[Any, PlanError]:
    """Each request with a transfer the rules refuse, with the first error of its first bad transfer.

    Then, among the rest, both requests of every pair that claims one destination item
    (planning.md §6.1), each with that pair's :class:`~kvplan.errors.DestinationOverlapError`.
    """
    refused: dict[Any, PlanError] = {}
    claims = []
    for t in batch.transfers:
        if t.request in refused:
            continue
        try:
            claims.append(Claims.of_lists(t, transfer_lists(batch, t)))
        except PlanError as err:
            refused[t.request] = err
    for err in overlaps([c for c in claims if c.request not in refused], [c.name for c in batch.src.state]):
        for request in (err.request, err.other):
            refused.setdefault(request, err)
    return refused


def without(batch: Batch, requests: Iterable[Any]) -> Batch:
    """The batch less every transfer of ``requests``."""
    gone = set(requests)
    return replace(batch, transfers=tuple(t for t in batch.transfers if t.request not in gone))


def plan_each(batch: Batch, plan: Callable[[Batch], PendingPlan] | None = None
              ) -> tuple[PendingPlan, dict[Any, PlanError]]:
    """Plan every request of ``batch`` that plans; return the plan and the refused requests' errors.

    ``plan`` makes a pending plan of a batch (default: :func:`kvplan.planner.device.eager.plan`). Unlike
    ``plan`` this waits for the device: it must know whether the batch plans.
    """
    if plan is None:
        from .eager import plan
    refused: dict[Any, PlanError] = {}
    while True:
        pending = plan(batch)
        try:
            pending.check()
            return pending, refused
        except PlanError as err:
            found = refused_requests(batch) or {err.request: err}
            if not found.keys() & {t.request for t in batch.transfers}:
                raise  # an error of the whole batch, not of one of its requests
            refused.update(found)
            batch = without(batch, found)
