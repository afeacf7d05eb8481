"""A decode worker's pairing with its prefills (:class:`DecodePairing`, a part of
:class:`~kvplan.integrations.vllm.worker.ConnectorWorker`): one decode endpoint per prefill rank (or group
of ranks gathered from), made and paired on a thread of its own, off the step's path; the requests that
wait for it published once it is paired, or failed with the reason.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ...errors import KvplanError, PeerError
from ...transport.decode import DecodeEndpoint
from ...transport.auth import channel_secret
from ...transport.listener import channel_via
from ..off_thread import OffThread
from .scheduler import ReceiveRequest
from ...transport.control_messages import Kind

__all__ = ["DecodePairing", "HANDSHAKE_S", "Pairing", "REGISTER_S"]

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


class DecodePairing:
    """The pairing half of :class:`~kvplan.integrations.vllm.worker.ConnectorWorker` (its state lives on the worker)."""

    def _key(self, receive: ReceiveRequest) -> tuple[str, int, tuple[int, ...]]:
        return (receive.remote_host, int(receive.remote_port), self._prefill_ranks(receive))

    @staticmethod
    def _none_needed(decode: DecodeEndpoint, remote: str) -> None:
        for channel in decode.channels:
            try:
                channel.send(Kind.ABORT, {"request": remote, "reason": "the decode needs none of it"}, timeout=0.1)
            except KvplanError as err:  # (its prefill frees them at its own deadline)
                log.warning("request %s: could not tell its prefill that no block of it is needed: %s", remote, err)

    def _connect(self, host: str, port: int, ranks: tuple[int, ...]) -> DecodeEndpoint | None:
        """The decode endpoint paired with ranks ``ranks`` of the prefill listening at ``host:port`` (rank
        ``r`` at ``port + r``): one per prefill rank, or per group of ranks gathered from, each with its
        engine and its staging buffer (a staged run lands in its own). ``None`` while it is being paired
        (on a thread of its own: :class:`Pairing`); raises :class:`PeerError` for a prefill that did
        not answer a moment ago."""
        key = (host, int(port), ranks)
        decode = self.decodes.get(key)
        if decode is not None:
            if not self._lost(decode):
                return decode
            self._retire(key)  # (its prefill ended or restarted: whoever listens at its address now is paired anew)
        until, reason = self._unreachable.get(key, (0.0, ""))
        if time.monotonic() < until:  # (its other requests of the moment fail at once, not one wait each)
            raise PeerError(reason)
        if key not in self._pairings:
            self._pairings[key] = Pairing(lambda: self._pair(host, port, ranks))
        return None

    @staticmethod
    def _lost(decode: DecodeEndpoint) -> bool:
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
        self._retired.add(decode)

    def _take_pairings(self) -> None:
        """Take each pairing that ended: publish its waiting requests, or fail them with the reason."""
        for key, pairing in [(k, p) for k, p in self._pairings.items() if p.done()]:
            del self._pairings[key]
            if pairing.endpoint is None:
                reason = pairing.reason()
                self._unreachable[key] = (time.monotonic() + HANDSHAKE_S, reason)
                for request_id, receive, row in pairing.waiting:
                    self._recv_rows.give(row)
                    self._recv_maps.release(receive.remote_request_id)
                    self._fail_unpublished(request_id, receive, f"PeerError: {reason}")
                continue
            self.decodes[key] = pairing.endpoint
            for remote in pairing.none_needed:
                self._none_needed(pairing.endpoint, remote)
            for request_id, receive, row in pairing.waiting:
                try:
                    self._publish_to(pairing.endpoint, request_id, receive, row)
                except KvplanError as err:
                    self._recv_rows.give(row)
                    self._recv_maps.release(receive.remote_request_id)
                    self._fail_unpublished(request_id, receive, f"{type(err).__name__}: {err}")

    def _pair(self, host: str, port: int, ranks: tuple[int, ...]) -> DecodeEndpoint:
        """Make the decode endpoint of :meth:`_connect` and pair it (on its pairing's thread): its engine made
        and its memory registered first (seconds on a cold device), then a channel asked of each prefill
        rank, on which it registers at once (each listener closes a channel that waits past its bound)."""
        start = time.perf_counter()
        # (a missing secret is the deployment's error, said as such: not a prefill that did not answer)
        secret = channel_secret(host, self.settings.secret(), insecure=self.settings.insecure)
        decode = DecodeEndpoint(self.view.side(self._recv_table, self.tp_size, self.tp_rank, self._recv_maps.maps,
                                               self._recv_states.maps),
                                self._engine("receive"), [], staging=self._staging(), compat=self.view.word,
                                senders=len(ranks), integrity=self.settings.integrity)
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
            self._engines.remove(decode.engine)  # (its registrations and staging buffer go with it: a pairing
            decode.engine.close()                # tried again makes new ones)
            raise
        log.info("rank %d paired with prefill ranks %s at %s:%d: endpoint %.1f ms, warm-up %.1f ms", self.tp_rank,
                 list(ranks), host, int(port), (made - start) * 1e3, (time.perf_counter() - made) * 1e3)
        return decode
