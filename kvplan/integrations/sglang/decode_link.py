"""A decode rank's control path in SGLang's protocol (0.5.23, Mooncake or NIXL backend), spoken by kvplan.

The mirror of :mod:`.rank_link`: a kvplan decode rank served by SGLang's own prefill. It finds the
prefill rank through SGLang's bootstrap server (:mod:`.bootstrap`), checks that the prefill's layout
is one it can take (page size, KV dtype, one prefill rank), registers its buffers with it, asks for
each request (destination pages, aux row, state lists, decode prefix), and reads each request's
status from its own ZeroMQ PULL socket. SGLang's prefill writes the bytes itself, through its engine,
into the buffers this rank registered with its engine.

Nothing from the prefill is trusted: a status message is parsed strictly (:func:`~.wire.parse_status`),
and one that is malformed, names a room this rank never asked for or comes from another prefill rank
is dropped with a warning.

Example::

    link = DecodeRankLink(session_id=engine.name, rank_ip="127.0.0.1")  # binds the address given
    link.connect("127.0.0.1", bootstrap_port, registration, page_size=64, kv_cache_dtype="bfloat16")
    link.ask(TransferRequest(room=7, endpoint=link.rank_ip, port=link.rank_port, session_id=engine.name,
                             dst_pages=pages, aux_index=3))
    for status in link.poll(timeout=0.1):                       # StatusMessage(room, status, rank, reason)
        ...
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from ...errors import LayoutError, PeerError
from .bootstrap import PrefillLayout, prefill_layout, prefill_rank
from .sockets import push, push_socket
from .wire import (
    FAILED,
    SUCCESS,
    Abort,
    Registration,
    StatusMessage,
    TransferRequest,
    abort_frames,
    parse_abort_ack,
    parse_status,
    registration_frames,
    transfer_frames,
)

__all__ = ["DecodeRankLink"]

log = logging.getLogger(__name__)


class DecodeRankLink:
    """One decode rank's control socket in SGLang's protocol (see the module docstring).

    ``session_id``: this rank's engine session (for Mooncake, ``host:rpc_port``; for NIXL, its agent's
    name), which SGLang's prefill writes to. ``asked``: the rooms asked for and not yet settled. ``aborting``: the rooms
    aborted and not yet acknowledged, with the abort's generation; ``acked``: those acknowledged (the
    prefill writes nothing more of them, so their pages may be reused).
    """

    def __init__(self, session_id: str, *, rank_ip: str, backend: str = "mooncake"):
        import zmq

        self._zmq = zmq
        self.session_id, self.rank_ip, self.backend = session_id, rank_ip, backend
        self.socket = zmq.Context.instance().socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.rank_port = self.socket.bind_to_random_port(f"tcp://{rank_ip}")
        self.prefill: tuple[str, int] | None = None  # the prefill rank's control socket
        self.layout: PrefillLayout | None = None
        self.asked: set[int] = set()
        self.aborting: dict[int, int] = {}
        self.acked: set[int] = set()
        self._generation = 0
        self._push: Any = None

    def connect(self, bootstrap_host: str, bootstrap_port: int, registration: Registration, page_size: int,
                kv_cache_dtype: str, timeout: float = 5.0) -> PrefillLayout:
        """Look up the prefill through its bootstrap server, check its layout and register with its rank
        (``registration``'s endpoint, port and session are this link's). Raises
        :class:`~.bootstrap.BootstrapNotReady` while the prefill's ranks are not all registered, and
        :class:`LayoutError` for a prefill this rank cannot take."""
        layout = prefill_layout(bootstrap_host, bootstrap_port, timeout)
        if layout.page_size is not None and layout.page_size != page_size:
            raise LayoutError(f"the prefill's page size is {layout.page_size}, this decode's {page_size}")
        if layout.kv_cache_dtype is not None and layout.kv_cache_dtype != kv_cache_dtype:
            raise LayoutError(f"the prefill's KV cache dtype is {layout.kv_cache_dtype}, this decode's "
                              f"{kv_cache_dtype}")
        if (layout.attn_tp_size, layout.attn_cp_size, layout.dp_size, layout.pp_size) != (1, 1, 1, 1):
            raise LayoutError(f"the prefill has attention TP {layout.attn_tp_size}, CP {layout.attn_cp_size}, DP "
                              f"{layout.dp_size} and PP {layout.pp_size}; this version takes one prefill rank")
        if layout.decode_allocation_policy != "early":
            raise LayoutError(f"the prefill allocates with the {layout.decode_allocation_policy!r} policy; this "
                              "version takes 'early'")
        self.prefill = prefill_rank(bootstrap_host, bootstrap_port, tp_rank=0, timeout=timeout)
        self._push = push_socket(*self.prefill)
        self._send(registration_frames(replace(registration, endpoint=self.rank_ip, port=self.rank_port,
                                               session_id=self.session_id), self.backend), timeout)
        self.layout = layout
        return layout

    def ask(self, request: TransferRequest, timeout: float = 5.0) -> None:
        """Ask the prefill for one request (its endpoint, port and session are this link's)."""
        if self.prefill is None:
            raise LayoutError("this decode rank has not connected to a prefill")
        self._send(transfer_frames(replace(request, endpoint=self.rank_ip, port=self.rank_port,
                                           session_id=self.session_id), self.backend), timeout)
        self.asked.add(request.room)

    def abort(self, room: int, timeout: float = 1.0) -> None:
        """Tell the prefill to drop ``room`` and to acknowledge once nothing more of it will be
        written (SGLang's ``AbortNotification``); the ack shows in ``acked``."""
        self._generation += 1
        self.asked.discard(room)
        self.aborting[room] = self._generation
        self._send(abort_frames(Abort(room, self.rank_ip, self.rank_port, self._generation)), timeout)

    def poll(self, timeout: float = 0.0) -> list[StatusMessage]:
        """The status messages that have arrived for rooms this rank asked for (waiting up to
        ``timeout`` seconds for the first); a settled room (``Success`` or ``Failed``) is no longer asked."""
        out: list[StatusMessage] = []
        wait_ms = max(0, round(timeout * 1000))
        while self.socket.poll(wait_ms):
            wait_ms = 0
            frames = self.socket.recv_multipart()
            try:
                ack = parse_abort_ack(frames)
                if ack is not None:
                    if ack.room in self.aborting and self.aborting[ack.room] == ack.generation:  # else stale or foreign
                        del self.aborting[ack.room]
                        self.acked.add(ack.room)
                    continue
                status = parse_status(frames, self.backend)
            except PeerError as err:
                log.warning("dropped a malformed message from the prefill: %s", err)
                continue
            if status is None:
                continue
            if status.room not in self.asked:
                log.warning("dropped a status for room %d, which this decode rank has not asked for", status.room)
                continue
            if status.prefill_rank != 0:
                log.warning("dropped room %d's status from prefill rank %d (this rank's prefill is rank 0)",
                            status.room, status.prefill_rank)
                continue
            if status.status in (FAILED, SUCCESS):  # the room is settled
                self.asked.discard(status.room)
            out.append(status)
        return out

    def _send(self, frames: list[bytes], timeout: float) -> None:
        push(self._push, frames, timeout, f"the prefill rank at {self.prefill[0]}:{self.prefill[1]}")

    def close(self) -> None:
        if self._push is not None:
            self._push.close()
        self.socket.close()
