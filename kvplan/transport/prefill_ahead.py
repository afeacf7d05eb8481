"""What a prefill endpoint does before the host has read a batch's plan (:class:`AheadOfPlan`, a part
of :class:`~kvplan.transport.prefill.PrefillEndpoint`): a staged run's first gather and a direct send's copy
queued behind the plan, a staged run's chunks announced to a receiver that plans it, and the staging
ring and copy word those steps share.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

from ..planner.contract.batch import Batch, Transfer
from .ahead import GatherAhead
from .control import ControlTimeout
from .local import plan_alignment
from .senders.planned import LaunchAhead
from .receiver_plan import planned_run_chunks
from .waves import staging_ring
from .control_messages import Kind

__all__ = ["AheadOfPlan"]

log = logging.getLogger(__name__)


class AheadOfPlan:
    """The steps of :class:`~kvplan.transport.prefill.PrefillEndpoint` queued ahead of the host's view of a plan (its state lives on the endpoint)."""

    def _alignment(self, batch: Batch) -> int:
        """:func:`~.local.plan_alignment` of the batch's sides (it depends on nothing else), kept per
        pairing: a send asks for it up to three times, and it walks every entry of both sides."""
        sides = (batch.src, *batch.dsts)
        kept = self._alignments
        if kept is None or len(kept[0]) != len(sides) or any(a is not b for a, b in zip(kept[0], sides)):
            kept = self._alignments = (sides, plan_alignment(batch))
        return kept[1]

    def _ring(self, dest: int, alignment: int, local_bytes: int | None = None) -> tuple[int, int]:
        """``(slots, slot_bytes)`` of the staging ring to peer ``dest`` over ``local_bytes`` of this side's
        staging buffer (all of it by default)."""
        local = self.staging.numel() if local_bytes is None else local_bytes
        return staging_ring(min(local, self.peers[dest].staging[1]), self.slots, alignment)

    def _staged_to_one(self, mode: str) -> bool:
        """Whether a send in ``mode`` will likely be one staged run to a single peer (``auto``: as the
        last send was), before its plan is seen: what is done ahead of the plan rests on it."""
        return len(self.peers) == 1 and self.staging is not None and self.peers[0].staging is not None and \
            (mode == "staged" or mode == "auto" and self.last_mode == "staged")

    def _gather_ahead(self, pending, batch: Batch, mode: str) -> GatherAhead | None:
        """Queue the first wave's gather behind ``pending`` when the send will likely be staged to a
        single peer (:mod:`.ahead`); its run uses it unless the batch turns out otherwise."""
        if self._ahead is None or not self._staged_to_one(mode) or self.sending.runs:
            return None  # (a run still moving uses the ring, and the gatherer's offsets)
        alignment = self._alignment(batch)
        return self._ahead.queue(pending, alignment, self._ring(0, alignment)[1])

    def _launch_ahead(self, pending, batch: Batch, mode: str) -> LaunchAhead | None:
        """Queue a direct send's one launch behind ``pending``, before the host has read the plan, where
        the engine writes from device descriptors (:attr:`~.engines.Capabilities.device`) and the batch goes
        to one decode endpoint: the copy runs the moment the plan ends, while this thread reads the plan's
        sections, whose handles then attach to it (:mod:`.senders.direct`). A refused plan counts 0 rows:
        its launch writes nothing. Not for the first such send, whose descriptors' size shapes the next's
        copy kernel (:attr:`_device_typical`)."""
        dests = {t.dest for t in batch.transfers}
        if not self.engine.capabilities.device or mode not in ("direct", "auto") or len(dests) != 1 or \
                self._device_typical is None:
            return None
        dest = dests.pop()
        descs, rows = pending.device_rows()
        launch = self.engine.launch_device(self.peers[dest].name, descs, rows=rows, alignment=self._alignment(batch),
                                           typical_bytes=self._device_typical)
        self.launches_ahead += 1
        return LaunchAhead(dest, launch)

    def _announce_chunks(self, transfers: Sequence[Transfer], batch: Batch, mode: str, timeout: float) -> int | None:
        """Announce a staged run's chunks to a receiver that plans it (:func:`.receiver_plan.planned_run_chunks`)
        before this side's plan is launched, so that both plan at once; its waves follow once this
        side's plan is seen and its first wave posted. The run's id, or ``None`` where the send will not be such a run."""
        peer = self.peers[0]
        if not (self.receiver_plans and transfers and self._staged_to_one(mode) and peer.plannable
                and all(t.request in peer.planning for t in transfers)):
            return None
        run, self._next_run = self._next_run, self._next_run + 1
        peer.channel.replaced()  # a connection made again before this run loses nothing of it
        try:
            peer.channel.send(Kind.STAGED_PLAN, planned_run_chunks(self.id, self._alignment(batch), transfers, run),
                              timeout=timeout)
        except ControlTimeout:
            return None  # (then announced whole, or failed, by the staged run)
        self.sending.times.append(("chunks", time.perf_counter()))
        return run

    def _cancel_chunks(self, run: int | None, why: str) -> None:
        """Withdraw a run announced by its chunks that will not be sent as one (its requests are
        failed or sent otherwise, and told so by their own messages)."""
        if run is not None:
            try:
                self.peers[0].channel.send(Kind.STAGED_WAVES, {"from": self.id, "run": run, "cancel": why}, timeout=1.0)
            except ControlTimeout:
                log.warning("could not withdraw staged run %d from the decode side", run)
