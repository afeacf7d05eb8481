"""A planned batch as the senders take it: one peer's share of a plan, its descriptors on the device
and, copied when first needed, on the host (:class:`PlannedBatch`); and descriptors cut to fit a
staging slot (:func:`split_descriptors`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ...planner.contract.batch import Transfer
from ...planner.contract.plan import Section
from ..ahead import GatherAhead

__all__ = ["LaunchAhead", "PlannedBatch", "split_descriptors"]


@dataclass
class LaunchAhead:
    """A direct send's one launch, queued behind its plan before the host read it
    (:meth:`~kvplan.transport.prefill.PrefillEndpoint._launch_ahead`): to decode endpoint ``dest``,
    over the plan's rows as they lie in its buffer; its sections' handles attach once read."""

    dest: int
    launch: Any  # the engine's (:meth:`~kvplan.transport.engines.ipc.IpcEngine.launch_device`)


@dataclass
class PlannedBatch:
    """What staged mode needs of one peer's share of a planned batch."""

    transfers: Sequence[Transfer]
    descs: np.ndarray | None  # [n, 3] uint64 on the host (destination tables, wave cuts); None: not copied yet
    per_transfer: np.ndarray  # [T + 1] descriptor offsets
    sections: list[Section] | None  # None: not read from the plan yet
    device_descs: torch.Tensor  # the same descriptors on the device (what the gathers read)
    plannable: bool = True  # False: a part of a plan (a layer group) the receiver cannot plan itself
    ahead: GatherAhead | None = None  # its first wave, gathered behind the plan (.ahead)
    chunks_run: int | None = None  # the id under which its chunks were announced ahead of the plan
    nbytes: int | None = None  # the descriptors' bytes (None: summed from descs)
    pending: Any = None  # the plan, where descs were not copied to the host
    launched: LaunchAhead | None = None  # (direct, device engines) its launch, queued behind the plan

    def __post_init__(self) -> None:
        if self.nbytes is None:
            self.nbytes = int(self.descs[:, 2].sum(dtype=np.uint64))

    def host_descs(self) -> np.ndarray:
        """The descriptors in host memory, copied from the plan the first time they are needed."""
        if self.descs is None:
            self.descs = self.pending.descriptors()[0]
        return self.descs

    def host_sections(self) -> list[Section]:
        """The sections, read from the plan's report the first time they are needed."""
        if self.sections is None:
            self.sections = self.pending.sections()
        return self.sections


def split_descriptors(descs: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Descriptors of at most ``limit`` bytes: ``(pieces, first)``; descriptor ``i`` became pieces
    ``first[i]:first[i + 1]`` (``limit`` keeps the alignment when it is a multiple of it). When none
    is larger than ``limit``: ``(descs, None)``, with nothing copied."""
    if not len(descs) or int(descs[:, 2].max()) <= limit:  # the usual case
        return descs, None
    sizes = descs[:, 2].astype(np.int64)
    count = np.maximum(1, -(-sizes // limit))
    first = np.concatenate([[0], np.cumsum(count)])
    if int(first[-1]) == len(descs):
        return descs, first
    owner = np.repeat(np.arange(len(descs)), count)
    k = (np.arange(int(first[-1])) - first[owner]).astype(np.uint64)
    step = np.uint64(limit)
    pieces = np.empty((int(first[-1]), 3), np.uint64)
    pieces[:, 0] = descs[owner, 0] + k * step
    pieces[:, 1] = descs[owner, 1] + k * step
    pieces[:, 2] = np.minimum(descs[owner, 2] - k * step, step)
    return pieces, first
