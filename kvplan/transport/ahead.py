"""A staged run's first wave, gathered behind its plan before the host has seen the plan.

Without it a staged send goes: plan on the device, wait for the host's view of the descriptors,
cut waves, announce, and only then queue the first gather. The host steps (~1 ms) and the gather
(~0.2 ms for 256 MiB on an H200) then follow each other. Here the gather of the byte window that
slot 0 holds is queued on the transport stream right behind the plan, reading the plan's descriptor
buffer through its count on the device (:meth:`~kvplan.planner.device.pending.PendingPlan.device_ahead`):
a refused plan has a count of 0 and reads nothing, and no byte goes past the slot. The first wave is
the window's first bytes, so the run only has to post it once the gather's event is done.

The kernel variant (tile or large descriptors) needs the typical descriptor size before the host
knows it: the size of the endpoint's previous staged run is used, so a first run gathers as before.
With ``graphs`` (:mod:`.copy_graphs`) the gather is a graph replay once the same planner buffers and
launch shape recur: the plan's buffers are its bucket slot's, counted by the plan on the device.

Example::

    gatherer = AheadGatherer(staging, stream, CopyGraphs(capture_stream))
    pending = planner.plan(batch)
    ahead = gatherer.queue(pending, alignment, slot_bytes)   # None on a first run
    descs, offsets = pending.descriptors()                    # the host waits meanwhile
    ... ahead.serves(pending.device_descriptors(), slot_bytes) -> wave 0 is in slot 0 once ahead.event is done
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.copy import launch_shape
from .copy_graphs import CopyGraphs
from .local import gather

__all__ = ["AheadGatherer", "GatherAhead"]


@dataclass
class GatherAhead:
    """Bytes ``[0, slot_bytes)`` of a plan's staged stream, queued into slot 0 of the staging buffer."""

    descs: torch.Tensor  # the plan's whole descriptor buffer (its counted rows are the plan)
    offsets: torch.Tensor  # each row's byte offset in the stream (exclusive sums; valid for the counted rows)
    event: torch.cuda.Event  # recorded after the gather
    slot_bytes: int

    def serves(self, device_descs: torch.Tensor, slot_bytes: int) -> bool:
        """Whether this gather is the first wave of a run over ``device_descs`` (the plan's rows, not
        re-split) with slots of ``slot_bytes``."""
        return slot_bytes == self.slot_bytes and device_descs.data_ptr() == self.descs.data_ptr()


class AheadGatherer:
    """One endpoint's gathers ahead, and the descriptor size they expect."""

    def __init__(self, staging: torch.Tensor, stream: torch.cuda.Stream, graphs: CopyGraphs | None = None):
        self.staging, self.stream, self.graphs = staging, stream, graphs
        self.typical: int | None = None  # bytes per descriptor of the last staged run

    def queue(self, pending, alignment: int, slot_bytes: int) -> GatherAhead | None:
        """Queue the gather of slot 0's window behind ``pending`` (a :class:`~kvplan.planner.device.pending.PendingPlan`
        made on the current stream by a planner with ``"byte_offsets"``); ``None`` before the first staged
        run has set :attr:`typical`."""
        if self.typical is None or slot_bytes <= 0 or slot_bytes > self.staging.numel():
            return None
        typical = self.typical
        with torch.cuda.stream(self.stream):
            descs, offsets, rows = pending.device_ahead()  # (this stream now waits for the plan)

            def launch() -> None:
                gather(descs, offsets, self.staging, alignment, typical_bytes=typical, need=slot_bytes,
                       window=(0, slot_bytes), rows=rows)

            if self.graphs is None:
                launch()
            else:  # the plan's buffers recur with its bucket slot: everything the gather reads is in the key
                self.graphs.run(("gather", descs.data_ptr(), offsets.data_ptr(), rows.data_ptr(), descs.shape[0],
                                 launch_shape(typical, alignment), alignment, slot_bytes, self.staging.data_ptr()),
                                launch)
            event = torch.cuda.Event()
            event.record(self.stream)
        return GatherAhead(descs, offsets, event, slot_bytes)
