"""A decode worker's links to its prefills (:class:`PrefillLinks`, a part
:class:`~kvplan.integrations.vllm.worker.ConnectorWorker` owns): one decode endpoint per prefill rank (or group
of ranks gathered from), made and paired on a thread of its own, off the step's path; the requests that
wait for it, published once it is paired or failed with the reason; the endpoints whose prefill is gone,
polled until their requests settle.

Example::

    links = PrefillLinks(make=worker_endpoint, release=worker_release, settings=settings, tp_rank=0)
    decode = links.endpoint("10.0.0.3", 17500, (0,))   # None while it pairs: links.waiting(key).waiting.append(...)
    links.take_pairings(publish, fail)                  # at each step: the pairings that ended
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ...errors import KvplanError, PeerError
from ...transport.decode import DecodeEndpoint
from ...transport.auth import channel_secret
from ...transport.listener import channel_via
from ..off_thread import OffThread
from .retired import RetiredEndpoints
from .scheduler import ReceiveRequest
from ...transport.control_messages import Kind

__all__ = ["HANDSHAKE_S", "Pairing", "PrefillLinks", "REGISTER_S"]

log = logging.getLogger(__name__)

HANDSHAKE_S = 5.0  # how long a prefill may take to answer a decode's request for a channel, and to pair on it
# how long a decode that asked for a channel may take to register on it (its memory is registered before it asks,
# but its thread shares the interpreter with a model runner that may be compiling kernels on a cold start)
REGISTER_S = 30.0


class Pairing(OffThread[DecodeEndpoint]):
    """A decode endpoint made and paired with a prefill's ranks on a thread of its own, off the step's
    path: the requests that wait for it (published once it is paired, failed if it cannot be) and the
    prefill requests to tell that their decode needs none of them."""

    def __init__(self, make: Any):
        self.waiting: list[tuple[str, ReceiveRequest, int]] = []  # (request id, what vLLM said, its planning row)
        self.none_needed: list[str] = []  # the prefill's request ids whose decode needs none of their blocks
        super().__init__(make, "kvplan-vllm-pairing")

    @property
    def endpoint(self) -> DecodeEndpoint | None:
        return self.value


class PrefillLinks:
    """The decode endpoints of one worker, by prefill ``(host, port, ranks)``: those paired (``decodes``),
    those pairing (``pairings``), the prefills that did not answer a moment ago (``unreachable``) and the
    endpoints whose prefill is gone (``retired``). ``make(senders)`` makes an endpoint over the worker's
    receiving table (its engine and staging buffer its own), ``release(decode)`` lets one that did not pair go
    with its engine."""

    def __init__(self, make: Callable[[int], DecodeEndpoint], release: Callable[[DecodeEndpoint], None],
                 settings: Any, tp_rank: int):
        self._make, self._release, self.settings, self.tp_rank = make, release, settings, tp_rank
        self.decodes: dict[tuple[str, int, tuple[int, ...]], DecodeEndpoint] = {}
        self.pairings: dict[tuple[str, int, tuple[int, ...]], Pairing] = {}
        self.unreachable: dict[tuple[str, int, tuple[int, ...]], tuple[float, str]] = {}  # until, why
        self.retired = RetiredEndpoints()

    @staticmethod
    def none_needed(decode: DecodeEndpoint, remote: str) -> None:
        """Tell ``decode``'s prefill that no block of its request ``remote`` is needed (it frees them)."""
        for channel in decode.channels:
            try:
                channel.send(Kind.ABORT, {"request": remote, "reason": "the decode needs none of it"}, timeout=0.1)
            except KvplanError as err:  # (its prefill frees them at its own deadline)
                log.warning("request %s: could not tell its prefill that no block of it is needed: %s", remote, err)

    def endpoint(self, host: str, port: int, ranks: tuple[int, ...]) -> DecodeEndpoint | None:
        """The decode endpoint paired with ranks ``ranks`` of the prefill listening at ``host:port`` (rank
        ``r`` at ``port + r``): one per prefill rank, or per group of ranks gathered from, each with its
        engine and its staging buffer (a staged run lands in its own). ``None`` while it is being paired
        (on a thread of its own: :class:`Pairing`, whose ``waiting`` holds what to publish once it is);
        raises :class:`PeerError` for a prefill that did not answer a moment ago."""
        key = (host, int(port), ranks)
        decode = self.decodes.get(key)
        if decode is not None:
            if not self.lost(decode):
                return decode
            self._retire(key)  # (its prefill ended or restarted: whoever listens at its address now is paired anew)
        until, reason = self.unreachable.get(key, (0.0, ""))
        if time.monotonic() < until:  # (its other requests of the moment fail at once, not one wait each)
            raise PeerError(reason)
        if key not in self.pairings:
            self.pairings[key] = Pairing(lambda: self._pair(host, port, ranks))
        return None

    def live(self, key: tuple[str, int, tuple[int, ...]]) -> DecodeEndpoint | None:
        """The paired endpoint of ``key`` whose prefill is still there, else ``None``."""
        decode = self.decodes.get(key)
        return decode if decode is not None and not self.lost(decode) else None

    @staticmethod
    def lost(decode: DecodeEndpoint) -> bool:
        """Whether a prefill rank ``decode`` is paired with is gone: its control connection lost (the process
        ended, restarted, or went silent past its channel's timeout). A channel is never paired again by
        itself (each is a port the prefill's listener gave the process that is gone)."""
        return any(channel.peer_gone() for channel in decode.channels)

    def _retire(self, key: tuple[str, int, tuple[int, ...]]) -> None:
        """Take the decode endpoint of ``key`` out of use: the next request to that address pairs again. It
        is still polled while requests published through it settle (they fail: its prefill is gone, and
        their blocks wait for its fence), then closed with its engine (:class:`.retired.RetiredEndpoints`)."""
        decode = self.decodes.pop(key)
        log.warning("the prefill at %s:%d (ranks %s) is gone: pairing again with whatever listens there now",
                    key[0], key[1], list(key[2]))
        self.retired.add(decode)

    def take_pairings(self, publish: Callable[[DecodeEndpoint, str, Any, int], None],
                      fail: Callable[[str, Any, int, str], None]) -> None:
        """Each pairing that ended: its waiting requests published (``publish(decode, request id, receive,
        row)``), or failed with the reason (``fail(request id, receive, row, reason)``), as is one whose
        publication raised."""
        for key, pairing in [(k, p) for k, p in self.pairings.items() if p.done()]:
            del self.pairings[key]
            if pairing.endpoint is None:
                reason = pairing.reason()
                self.unreachable[key] = (time.monotonic() + HANDSHAKE_S, reason)
                for request_id, receive, row in pairing.waiting:
                    fail(request_id, receive, row, f"PeerError: {reason}")
                continue
            self.decodes[key] = pairing.endpoint
            for remote in pairing.none_needed:
                self.none_needed(pairing.endpoint, remote)
            for request_id, receive, row in pairing.waiting:
                try:
                    publish(pairing.endpoint, request_id, receive, row)
                except KvplanError as err:
                    fail(request_id, receive, row, f"{type(err).__name__}: {err}")

    def _pair(self, host: str, port: int, ranks: tuple[int, ...]) -> DecodeEndpoint:
        """Make the decode endpoint of :meth:`endpoint` and pair it (on its pairing's thread): its engine made
        and its memory registered first (seconds on a cold device), then a channel asked of each prefill
        rank, on which it registers at once (each listener closes a channel that waits past its bound)."""
        start = time.perf_counter()
        # (a missing secret is the deployment's error, said as such: not a prefill that did not answer)
        secret = channel_secret(host, self.settings.secret(), insecure=self.settings.insecure)
        decode = self._make(len(ranks))
        channels = []
        try:
            try:
                for rank in ranks:
                    channels.append(channel_via(host, int(port) + rank, timeout=HANDSHAKE_S, secret=secret,
                                                insecure=secret is None))
            except KvplanError as err:
                raise PeerError(f"the prefill at {host}:{int(port) + rank} did not answer: {err}") from None
            decode.attach_channels(channels)
            decode.register(timeout=HANDSHAKE_S)
            made = time.perf_counter()
            if self.settings.warm_up:  # (waits for the pairing: the prefill is stepping, it has this request to send)
                decode.warm_up(**self.settings.warm_up, timeout=HANDSHAKE_S)
        except BaseException:
            for channel in channels:
                channel.close()
            self._release(decode)  # (its registrations and staging buffer go with it: a pairing tried again
            raise                  # makes new ones)
        log.info("rank %d paired with prefill ranks %s at %s:%d: endpoint %.1f ms, warm-up %.1f ms", self.tp_rank,
                 list(ranks), host, int(port), (made - start) * 1e3, (time.perf_counter() - made) * 1e3)
        return decode

    def endpoints(self) -> list[DecodeEndpoint]:
        """Every open endpoint: paired, and retired (to poll)."""
        return [*self.decodes.values(), *self.retired]

    def close(self) -> list[Callable[[], None]]:
        """End the pairings in progress (each within ``HANDSHAKE_S``) and forget every endpoint: what closes
        their channels (the caller closes the engines)."""
        for pairing in self.pairings.values():
            pairing.join(HANDSHAKE_S)
            if pairing.endpoint is not None:
                self.decodes[("pairing", id(pairing), ())] = pairing.endpoint
        closers = [c.close for d in self.endpoints() for c in d.channels]
        self.pairings, self.decodes, self.retired = {}, {}, RetiredEndpoints()
        return closers
