"""A decode endpoint's start-up work (:class:`DecodeWarmUp`, a part of
:class:`~kvplan.transport.decode.DecodeEndpoint`): the destination-list kernels loaded, and with a staging
buffer the senders' pairings awaited, the scatter kernels compiled and the planners of receiver-planned
runs made ready, before the first batch would pay for them.
"""

from __future__ import annotations

import logging
import time

import torch

from ..errors import KvplanError
from ..kernels.copy import SCATTER
from ..planner.device.destinations import PreallocatedRequest, list_entries, plan_destinations
from .local import typical_sizes, warm_up
from .pause import Pause

__all__ = ["DecodeWarmUp"]

log = logging.getLogger(__name__)


class DecodeWarmUp:
    """The warm-up of :class:`~kvplan.transport.decode.DecodeEndpoint` (its state lives on the endpoint)."""

    def warm_up(self, max_transfers: int = 16, max_prompt_len: int = 8192, timeout: float = 30.0) -> dict[str, float]:
        """Do at start-up what the first batch would otherwise pay for: load the destination-list
        kernels of :meth:`publish` (a token table on the GPU); with a staging buffer, wait (up to
        ``timeout``) until every sender has paired, compile the scatter kernels for this side's launch
        shapes, and make every planner of receiver-planned runs ready for batches of up to
        ``max_transfers`` transfers of requests of up to ``max_prompt_len`` tokens
        (:meth:`~kvplan.planner.device.planner.Planner.warm_up`). Call it after :meth:`register`, before the
        first :meth:`publish`; the sender's :meth:`PrefillEndpoint.warm_up` runs meanwhile. Returns
        the seconds each step took. Off the GPU there is nothing to compile or capture.

        Example::

            decode.register()
            decode.warm_up(max_transfers=64, max_prompt_len=8192)
        """
        self._before_thread("warm_up")
        took: dict[str, float] = {}
        table = self.side.req_to_token
        if isinstance(table, torch.Tensor) and table.is_cuda:
            start = time.perf_counter()
            self._warm_lists()
            took["lists"] = time.perf_counter() - start
        if self.staging is None:
            return took
        start = time.perf_counter()
        deadline, pause = time.monotonic() + timeout, Pause()

        def waiting() -> list[int]:  # (a sender that refused, or whose process ended, will not pair now)
            return [k for k in range(len(self.channels))
                    if k not in self._senders and k not in self._refused and k not in self._gone_senders]

        while waiting() and time.monotonic() < deadline:
            self._poll()
            pause()
        if len(self._senders) < len(self.channels):
            log.warning("warm-up: %d of %d senders had not paired after %.1f s (%d refused the pairing, %d are gone); "
                        "their planners start cold", len(self.channels) - len(self._senders), len(self.channels),
                        time.perf_counter() - start, len(self._refused),
                        len(set(self._gone_senders) - set(self._senders)))
        took["pairing"] = time.perf_counter() - start
        if not self.staging.is_cuda:  # (off the GPU nothing is compiled or captured)
            return took
        start = time.perf_counter()
        warm_up(self.staging, self._alignment, typical_sizes(self.side), kinds=(SCATTER,))
        took["kernels"] = time.perf_counter() - start
        start = time.perf_counter()
        warmed: set[int] = set()
        for peer in list(self._scatter_from):
            planner, _ = self._scatter_planner(peer)
            if id(planner) not in warmed:
                warmed.add(id(planner))
                planner.warm_up(max_transfers, list_entries(planner.src, max_prompt_len), stream=self._stream)
        took["planners"] = time.perf_counter() - start
        log.info("decode endpoint warmed up: %s", ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in took.items()))
        return took

    def _warm_lists(self) -> None:
        """Load the destination-list kernels a first :meth:`publish` would (11-29 ms on an H200, session
        27): the lists of one page of the token table's first row, computed and dropped (nothing is
        published or tracked; whatever that row holds, an error it raises is dropped too)."""
        side = self.side
        request = PreallocatedRequest("kvplan-warm-up", 0, min(side.kv.page_size, side.req_to_token.shape[1]))
        try:
            plan_destinations(side, [request], validate=False).result()
        except KvplanError as err:  # (row 0 may hold anything now: the kernels ran all the same)
            log.debug("warm-up: the destination lists of row 0 were refused (%s)", err)
