"""How a prefill endpoint ends what it sent (:class:`FailurePath`, a part of
:class:`~kvplan.transport.prefill.PrefillEndpoint`): every sender's writes are settled under the deadline
here, and a request is failed, and reported to its decode side, only here, once, keeping requests whose
writes may still land as unsafe (never acknowledged as fenced).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from ..planner.contract.batch import Transfer
from .engines import Handle, Waiting, is_unsafe
from .prefill_peers import pairing_of
from .control_messages import Kind

__all__ = ["FailurePath", "Settling"]

log = logging.getLogger(__name__)


class FailurePath:
    """The completion and fencing path of :class:`~kvplan.transport.prefill.PrefillEndpoint` (its state lives on the endpoint)."""

    def _peer_gone(self, peer: int) -> str | None:
        p = self.peers[peer]
        if p.channel.peer_gone():
            return "the decode side is gone: its control connection was lost"
        if p.pairing is not None and pairing_of(p.channel) != p.pairing:  # (None: a peer not paired here)
            return ("the decode side is gone: its control connection was made again since it registered (a "
                    "restarted process, or a connection lost and made again); what it published is dropped")
        return None

    def _any_peer_gone(self, peers: Sequence[int]) -> str | None:
        return next((why for p in peers if (why := self._peer_gone(p)) is not None), None)

    def fail(self, requests: Sequence[Any], reason: str, peer: int = 0) -> None:
        """Tell decode endpoint ``peer`` that ``requests`` failed here before anything was sent (and
        drop their lists): its side fails them at once instead of at their deadline. With a progress
        thread, that thread tells it, between batches."""
        if self._thread is not None:
            requests = list(requests)
            self._thread.call(lambda: self._fail_now(requests, reason, peer))
            return
        self._fail_now(requests, reason, peer)

    def _fail_now(self, requests: Sequence[Any], reason: str, peer: int = 0) -> None:
        for request in requests:
            self._report(peer, request, reason)
        self._forget_now(requests, peer)

    def _report(self, peer: int, request: Any, reason: str) -> None:
        log.warning("request %r failed: %s", request, reason)
        try:
            self.peers[peer].channel.send(Kind.FAILED, {"request": request, "reason": reason}, timeout=0.5)
        except Exception as err:  # noqa: BLE001 - the peer may be gone; the failure is still ours to report
            log.warning("could not tell the decode side that %r failed: %s", request, err)

    def _fail(self, peer: int, result: dict[Any, str | None], requests, reason: str) -> None:
        """Fail ``requests`` of one send with ``reason``, each reported once, except that a reason saying a
        write could not be ended (``unsafe``) replaces an earlier one and is reported again: an ``unsafe``
        reason is never replaced, and the decode side unfences what an earlier report fenced."""
        for request in requests:
            if is_unsafe(reason):  # a write into its pages may still land: never acknowledged as fenced
                self.unsafe.add(request)
            if result.get(request) is None or (is_unsafe(reason) and not is_unsafe(result[request])):
                result[request] = reason
                self._report(peer, request, reason)

    def _settle(self, transfers: Sequence[Transfer], posted: list[tuple[Handle, Any]],
                deadline: float) -> "Settling":
        """What ``posted`` (handle, section) pairs settle into, as a :class:`~.runtime.moving.Moving`: step it
        until done, then read each transfer's request's result."""
        return Settling(self, transfers, posted, deadline)


class Settling:
    """Posted writes ending under their deadline (:class:`~.engines.base.Waiting`), then their requests'
    results: one reason per request, reported once; a write that could not be ended makes its request
    unsafe whatever else failed (the decode then never reuses pages that may still be written)."""

    def __init__(self, ep: FailurePath, transfers: Sequence[Transfer], posted: list[tuple[Handle, Any]],
                 deadline: float):
        self.ep, self.transfers, self.posted = ep, transfers, posted
        dest_of = {handle: transfers[section.transfer].dest for handle, section in posted}
        self.waiting = Waiting(ep.engine, [h for h, _ in posted], deadline, give_up=lambda h: ep._peer_gone(dest_of[h]))
        self._result: dict[Any, str | None] | None = None

    def step(self) -> bool:
        return self.waiting.step()

    def done(self) -> bool:
        return self.waiting.done()

    def channels(self) -> Sequence[Any]:
        return ()  # (a message moves no write: the engine's states are looked at each slice)

    def result(self) -> dict[Any, str | None]:
        if self._result is not None:
            return self._result
        ep, transfers, outcome = self.ep, self.transfers, self.waiting.outcome
        result: dict[Any, str | None] = {t.request: None for t in transfers}
        reasons: dict[Any, tuple[int, str]] = {}
        for handle, section in self.posted:
            if (why := outcome[handle]) is not None:
                dest = transfers[section.transfer].dest
                gone = ep._peer_gone(dest)
                if is_unsafe(why):
                    why = f"{why} ({gone})" if gone else why
                elif gone:  # a dead receiver is the cause, whatever the engine says about a write that ended
                    why = gone
                if section.request not in reasons or (is_unsafe(why) and not is_unsafe(reasons[section.request][1])):
                    reasons[section.request] = (dest, why)
        for request, (dest, why) in reasons.items():
            ep._fail(dest, result, [request], why)
        self._result = result
        return result
