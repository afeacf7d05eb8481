"""A prefill rank's control path in SGLang's protocol (0.5.23, Mooncake or NIXL backend), spoken by kvplan.

SGLang's decode ranks find a prefill rank through the bootstrap server (:mod:`.bootstrap`), then
push to its control socket (a ZeroMQ PULL socket): one registration per decode rank, one transfer
request per request and decode rank, and aborts. The prefill rank pushes each request's status back
to every decode rank that asked for it. :class:`PrefillRankLink` is that socket and those answers,
with kvplan's strict codecs (:mod:`.wire`): a malformed message is dropped with a warning naming the
field, and nothing of it is kept. Moving the bytes is not its job: a caller plans and writes them with
kvplan, and reports the outcome with :meth:`PrefillRankLink.send_status`.

SGLang's registration carries no pool sizes, so a prefill cannot bound-check the decode's pages
against its pools from it; a caller that writes must bound them by other means (docs/sglang.md).

Example::

    link = PrefillRankLink(rank_ip="127.0.0.1", backend="mooncake")  # binds the address given, on a free port
    link.register("127.0.0.1", bootstrap_port, page_size=64, kv_cache_dtype="bfloat16")
    for kind, key in link.poll(timeout=0.1):                     # ("registered", session), ("request", room), ...
        if kind == "request" and link.complete(key):
            ...                                                  # plan and write link.requests[key]
            link.send_status(key, SUCCESS)
"""

from __future__ import annotations

import logging
from typing import Any

from ...errors import PeerError
from .bootstrap import RankRoute, register_rank
from .sockets import push, push_socket
from .wire import (
    ABORT_TAG,
    FAILED,
    SUCCESS,
    WAITING_FOR_INPUT,
    Abort,
    AbortAck,
    Registration,
    StatusMessage,
    TransferRequest,
    abort_ack_frames,
    is_registration,
    parse_abort,
    parse_registration,
    parse_transfer,
    status_frames,
)

__all__ = ["FAILED", "SUCCESS", "WAITING_FOR_INPUT", "PrefillRankLink"]

log = logging.getLogger(__name__)



class PrefillRankLink:
    """One prefill rank's control socket in SGLang's protocol (see the module docstring).

    ``registrations``: each decode rank's :class:`~.wire.Registration`, by its session id.
    ``requests``: per room, each decode rank's :class:`~.wire.TransferRequest`, by session id.
    ``aborts``: the rooms a decode rank aborted, with the abort.
    """

    def __init__(self, *, rank_ip: str, rank_port: int | None = None, backend: str = "mooncake",
                 prefill_rank: int = 0):
        import zmq

        self._zmq = zmq
        self.rank_ip, self.backend, self.prefill_rank = rank_ip, backend, prefill_rank
        self.socket = zmq.Context.instance().socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        if rank_port is None:
            self.rank_port = self.socket.bind_to_random_port(f"tcp://{rank_ip}")
        else:
            self.socket.bind(f"tcp://{rank_ip}:{rank_port}")
            self.rank_port = rank_port
        self._pushers: dict[tuple[str, int], Any] = {}
        self.registrations: dict[str, Registration] = {}
        self.requests: dict[int, dict[str, TransferRequest]] = {}
        self.aborts: dict[int, Abort] = {}

    def register(self, bootstrap_host: str, bootstrap_port: int, page_size: int, kv_cache_dtype: str,
                 timeout: float = 5.0, **layout: Any) -> RankRoute:
        """Register this rank's socket with the bootstrap server (``layout``: the other fields of
        :class:`~.bootstrap.RankRoute`, e.g. ``attn_tp_size`` and ``attn_tp_rank``); the route sent."""
        route = RankRoute(rank_ip=self.rank_ip, rank_port=self.rank_port, page_size=page_size,
                          kv_cache_dtype=kv_cache_dtype, **layout)
        register_rank(bootstrap_host, bootstrap_port, route, timeout)
        return route

    def poll(self, timeout: float = 0.0) -> list[tuple[str, Any]]:
        """Take in every message that has arrived, waiting up to ``timeout`` seconds for the first.
        Returns what happened, in order: ``("registered", session_id)``, ``("request", room)``,
        ``("abort", room)``."""
        events: list[tuple[str, Any]] = []
        wait_ms = max(0, round(timeout * 1000))
        while self.socket.poll(wait_ms):
            wait_ms = 0
            event = self._take(self.socket.recv_multipart())
            if event is not None:
                events.append(event)
        return events

    def _take(self, frames: list[bytes]) -> tuple[str, Any] | None:
        try:
            if frames and frames[0] == ABORT_TAG:
                abort = parse_abort(frames)
                self.aborts[abort.room] = abort
                return "abort", abort.room
            if is_registration(frames, self.backend):
                reg = parse_registration(frames, self.backend)
                self.registrations[reg.session_id] = reg
                return "registered", reg.session_id
            req = parse_transfer(frames, self.backend)
        except PeerError as err:
            log.warning("dropped a malformed message from a decode rank: %s", err)
            return None
        if req.session_id not in self.registrations:
            log.warning("dropped room %d's request from decode session %s, which has not registered", req.room,
                        req.session_id)
            return None
        self.requests.setdefault(req.room, {})[req.session_id] = req
        return "request", req.room

    def complete(self, room: int) -> bool:
        """Whether every decode rank that takes part in ``room`` has sent its request."""
        asked = self.requests.get(room, {})
        return bool(asked) and len(asked) >= max(r.required_dst_info_num for r in asked.values())

    def send_status(self, room: int, status: int, reason: str | None = None) -> None:
        """Push ``room``'s status to every decode rank that asked for it (each request names where), but
        the dummies: as SGLang's prefill, which tells a dummy rank nothing."""
        frames = status_frames(StatusMessage(room, status, self.prefill_rank, reason), self.backend)
        for req in self.requests.get(room, {}).values():
            if not req.is_dummy:
                self._push(req.endpoint, req.port, frames)

    def ack_abort(self, room: int) -> None:
        """Acknowledge ``room``'s abort where its decode rank asked for it (nothing more of it will be
        written), then forget the room."""
        abort = self.aborts.pop(room, None)
        self.requests.pop(room, None)
        if abort is not None and abort.decode_ip is not None and abort.decode_port is not None:
            self._push(abort.decode_ip, abort.decode_port,
                       abort_ack_frames(AbortAck(room, self.prefill_rank, abort.generation)))

    def forget(self, room: int) -> None:
        """Drop what this link holds for a settled room."""
        self.requests.pop(room, None)
        self.aborts.pop(room, None)

    def _push(self, host: str, port: int, frames: list[bytes], timeout: float = 1.0) -> None:
        sock = self._pushers.get((host, port))
        if sock is None:
            sock = self._pushers[(host, port)] = push_socket(host, port)
        push(sock, frames, timeout, f"the decode rank at {host}:{port}")

    def close(self) -> None:
        for sock in self._pushers.values():
            sock.close()
        self._pushers.clear()
        self.socket.close()

