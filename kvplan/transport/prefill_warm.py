"""A prefill endpoint's start-up work (:class:`WarmUp`, a part of
:class:`~kvplan.transport.prefill.PrefillEndpoint`): what a first batch would otherwise pay for, done for
every decode endpoint paired now and for each one as it pairs.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from ..planner.device.destinations import list_entries
from ..kernels.copy import GATHER
from ..planner.contract.batch import Batch
from ..planner.contract.pairing import smallest_descriptor
from .engines import wait_all
from .local import typical_sizes, warm_up
from .waves import touch_note

__all__ = ["WarmUp"]

log = logging.getLogger(__name__)

TOUCH_BYTES = 64 << 20  # the warm-up's write into each decode's staging share (_touch_peers)


class WarmUp:
    """The warm-up of :class:`~kvplan.transport.prefill.PrefillEndpoint` (its state lives on the endpoint)."""

    def warm_up(self, max_transfers: int = 16, max_prompt_len: int = 8192, timeout: float = 10.0) -> dict[str, float]:
        """Do at start-up what a first batch would otherwise pay for (measured: 250-760 ms against a
        steady 2-5 ms), for every decode endpoint paired now and, from then on, for each one as it
        pairs: the device planner made and every bucket of batches of up to ``max_transfers`` transfers
        of requests of up to ``max_prompt_len`` tokens captured
        (:meth:`~kvplan.planner.device.planner.Planner.warm_up`), the gather kernels compiled for the pairing's
        launch shapes, the first staged run's first gather shaped to go behind its plan, and the engine's
        connection to each decode's staging buffer opened by a write of up to 64 MiB into its share
        (nothing of a batch is there before the first run). Call it after
        :meth:`accept` (the decode side calls :meth:`DecodeEndpoint.warm_up` meanwhile). Returns the
        seconds each step took.

        Example::

            prefill.accept(timeout=30)
            prefill.warm_up(max_transfers=64, max_prompt_len=8192)
        """
        if max_transfers < 1 or max_prompt_len < 1:
            raise ValueError(f"warm_up needs at least one transfer of one token, got {max_transfers} x {max_prompt_len}")
        self._before_thread("warm_up")
        self._warm_shape = (max_transfers, max_prompt_len)
        return self._warm_peers(timeout)

    def _warm_peers(self, timeout: float) -> dict[str, float]:
        """:meth:`warm_up`'s steps for the peers paired now (none while any is still unpaired)."""
        took: dict[str, float] = {}
        if self._warm_shape is None or not self.peers or any(p.side is None for p in self.peers):
            return took
        max_transfers, max_prompt_len = self._warm_shape
        sides = tuple(p.side for p in self.peers)
        start = time.perf_counter()
        compiled = typical_sizes(self.side)  # (a launch shape each)
        alignment = self._alignment(Batch(self.side, sides, ()))
        if self.staging is not None and self.staging.is_cuda:
            warm_up(self.staging, alignment, compiled, kinds=(GATHER,))
        if self.engine.capabilities.device:  # its launches' kernels, and each peer's mapping opened
            for p in self.peers:
                self.engine.warm_up(p.name, typical_sizes(self.side, largest=4 << 20), alignment)
        took["kernels"] = time.perf_counter() - start
        start = time.perf_counter()
        self._planner(prepared=False).warm_up(max_transfers, max(list_entries(side, max_prompt_len) for side in sides))
        took["planners"] = time.perf_counter() - start
        if self._ahead is not None and self._ahead.typical is None:  # the first run's first wave behind its plan,
            # in a launch shape the kernels' warm-up above compiled
            self._ahead.typical = min(max(smallest_descriptor(self.side, sides), compiled[0]), compiled[-1])
        start = time.perf_counter()
        self._touch_peers(time.monotonic() + timeout)
        took["connections"] = time.perf_counter() - start
        log.info("prefill endpoint warmed up for %d decode endpoints: %s", len(self.peers),
                 ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in took.items()))
        return took

    def _touch_peers(self, deadline: float) -> None:
        """Open the engine's connection to each decode paired since the last warm-up and pay its first
        large write: the start of this side's staging buffer written over the start of its share (up to
        ``TOUCH_BYTES``: 64 MiB take 0.3 ms over NVLink, 30-60 ms over TCP; no run has gone there yet),
        with a notification the decode drops (:func:`~.waves.touch_note`): the engine's first one to it.
        On two H200s a first staged batch's write took 2.2 ms against 0.7 ms for the next ones after a
        16-byte touch (benchmarks/RESULTS.md, "Session 27")."""
        if self.staging is None or self.staging.numel() < 16:
            return
        handles = {}
        for k, p in enumerate(self.peers):
            if k not in self._touched and p.staging is not None and p.staging[1] >= 16 and p.name is not None \
                    and not p.dropped:
                self._touched.add(k)
                nbytes = min(self.staging.numel(), p.staging[1], TOUCH_BYTES)
                descs = np.array([[self.staging.data_ptr(), p.staging[0], nbytes]], dtype=np.uint64)
                note = p.sealed(touch_note(self.id)) if p.notified else b""
                handles[self.engine.post(p.name, descs, note)] = k
        for handle, reason in wait_all(self.engine, list(handles), deadline).items():
            if reason is not None:
                log.warning("warm-up: the write to decode endpoint %d's staging buffer failed: %s", handles[handle], reason)
