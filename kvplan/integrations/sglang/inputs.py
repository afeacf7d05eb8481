"""What SGLang's scheduler hands kvplan's adapter, as kvplan takes it: page and slot ids as int64
arrays, each state component's list of a last chunk (checked against the components), bootstrap
addresses as ``(host, port)``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from ...errors import InputError, LayoutError
from ...planner.contract.state_kinds import rules_of

__all__ = ["host_port", "ids", "nested", "state_lists", "state_lists_of"]


def host_port(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as ``(host, port)``; a clear error for anything else."""
    host, _, port = str(address).rpartition(":")
    if not host or not port.isdigit():
        raise LayoutError(f"{address!r} is not a host:port address")
    return host.strip("[]"), int(port)


def nested(values: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(v) for v in inner) for inner in (values or ()))


def ids(values: Any) -> np.ndarray:
    """SGLang's ids (a tensor, array or list) as int64."""
    values = values.cpu() if isinstance(values, torch.Tensor) else values
    return np.asarray(values, np.int64).reshape(-1)


def state_lists(state_indices: Optional[list]) -> tuple[np.ndarray, ...] | None:
    """SGLang's ``state_indices`` (one list per state component, or ``None``) as int64 arrays."""
    if state_indices is None:
        return None
    return tuple(ids([] if x is None else x) for x in state_indices)


def state_lists_of(room: int, state: tuple[np.ndarray, ...] | None, comps: Sequence[Any]) -> tuple[np.ndarray, ...]:
    """A last chunk's list of each component, or InputError naming the request: one list per
    component, one slot where the map is by row (a slot left out would move another request's state)."""
    names = [c.name for c in comps]
    if state is None or len(state) != len(names):
        raise InputError(room, f"its last chunk needs one state list per component {names}, got "
                               f"{'none' if state is None else len(state)}")
    for comp, ids in zip(comps, state):
        if rules_of(comp.kind).map_by_row and len(ids) != 1:
            raise InputError(room, f"state component {comp.name!r}: one slot per request, got {len(ids)} ids")
    return tuple(np.asarray(ids, np.int64) for ids in state)
