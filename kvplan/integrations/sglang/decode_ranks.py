"""SGLang's decode ranks as peers of a kvplan prefill endpoint (a kvplan prefill serving SGLang decodes).

An SGLang decode rank speaks SGLang's protocol (Mooncake or NIXL backend), not kvplan's: it registers and asks
for each request through the prefill rank's control socket (:class:`~.rank_link.PrefillRankLink`), and
learns that a request landed, or failed, from the prefill's status message, not from the write.
:class:`DecodeRanks` turns that into what a :class:`~kvplan.transport.prefill.PrefillEndpoint` plans
with: each registered rank becomes a peer, its memory built from its registration and the lengths it
does not register (:func:`~.kv_args.side_from_registration`) and checked to pair with this side; each
request whose every decode rank has asked becomes that peer's destination lists. The bytes then go as
direct writes without notifications, and :meth:`DecodeRanks.report` sends the request's status.

Nothing from the peer is trusted: a registration that does not pair with this side is refused (its
requests fail, naming the reason), malformed messages are dropped by the link, and the pages are
planned, so bounds-checked, against the pools the decode's lengths describe.

A request the decode's TP spreads over several ranks goes to each of them, planned in one batch (each
rank's share of the heads where the TP sizes differ). Scope: the ``early`` decode allocation policy, no
staging buffer (SGLang's decode-side staging protocol).

Example (inside a prefill manager; ``endpoint`` a PrefillEndpoint over a Mooncake or NIXL engine)::

    ranks = DecodeRanks(endpoint, PrefillRankLink(rank_ip="127.0.0.1", backend="nixl"), side_of=lambda reg: side_from_registration(reg, ...))
    ranks.link.register("127.0.0.1", bootstrap_port, page_size=64, kv_cache_dtype="bfloat16")
    published, failed = ranks.progress()       # rooms whose lists arrived; rooms that cannot be served
    ...
    ranks.report(room, ok=True)                # once the last chunk's writes have completed
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable

import numpy as np

from ...errors import KvplanError, PoolBoundsError
from ...planner.device.destinations import check_published
from ...planner.contract.batch import SideMemory
from ...planner.contract.plan import DestinationLists
from ...planner.contract.pairing import pair_sides
from ...transport.prefill import Peer, PrefillEndpoint
from .engine_identity import peer_name
from .rank_link import FAILED, SUCCESS, PrefillRankLink
from .wire import Registration, TransferRequest

__all__ = ["DecodeRanks"]

log = logging.getLogger(__name__)


class _StatusOnly:
    """The control channel of a peer that has none: an SGLang decode rank hears only its prefill's
    status messages, which :meth:`DecodeRanks.report` sends; kvplan's own messages have nowhere to go."""

    def __init__(self, session_id: str):
        self.session_id = session_id

    def send(self, kind: str, header: dict[str, Any] | None = None, *frames: bytes, timeout: float = 0.0) -> None:
        log.debug("kvplan's %r for SGLang decode session %s is not sent (its status is)", kind, self.session_id)

    closed = True  # (nothing comes on it: the progress thread's waits leave it out)

    def try_recv(self) -> None:
        return None

    def peer_gone(self) -> bool:
        return False  # SGLang's liveness checks run on the decode side (its heartbeats)

    def close(self) -> None:
        pass


class DecodeRanks:
    """The SGLang decode ranks ``endpoint`` sends to, through ``link`` (see the module docstring).

    ``side_of`` builds a registered rank's memory (raising :class:`~kvplan.errors.LayoutError` when it
    cannot); ``sessions`` maps each paired rank's session id to its peer index in ``endpoint``. The
    endpoint may run its progress thread: peers and their lists are given to it between its batches
    (:meth:`~kvplan.transport.prefill.PrefillEndpoint.between_batches`), nothing of them is written here;
    ``refused`` gives the reason for each rank that registered and could not pair; ``dummies`` holds
    the rooms asked for by dummy ranks only (nothing of them is this rank's to send).
    """

    def __init__(self, endpoint: PrefillEndpoint, link: PrefillRankLink,
                 side_of: Callable[[Registration], SideMemory]):
        self.endpoint, self.link, self.side_of = endpoint, link, side_of
        self.sessions: dict[str, int] = {}
        self.sides: dict[str, SideMemory] = {}  # each paired rank's memory, as checked here
        self._peers_given = len(endpoint.peers)  # peer indices given out (the peers are made between batches)
        self.refused: dict[str, str] = {}
        self._unserved: deque[tuple[int, str]] = deque()  # rooms refused between batches, and why
        self.dummies: set[int] = set()  # rooms whose every decode rank is a dummy here: nothing to send

    def progress(self, timeout: float = 0.0) -> tuple[list[int], list[tuple[int, str]]]:
        """Take in registrations, requests and aborts (waiting up to ``timeout`` for the first). Returns
        the rooms whose lists arrived, and those that cannot be served, each with the reason: the
        caller fails them (and reports them with :meth:`report`). An aborted room is acknowledged
        here, once its lists are dropped."""
        published, failed, handled = [], [], set()
        while self._unserved:  # (rooms whose ranks the engine could not reach, found between batches)
            failed.append(self._unserved.popleft())
        events = self.link.poll(timeout)
        for kind, key in events:  # every registration of the batch first: a room counts as complete once all
            if kind == "registered":  # its ranks' requests are in, and a later rank's may follow it in the batch
                self._pair(key)
        for kind, key in events:
            if kind == "registered":
                continue
            elif kind == "request" and self.link.complete(key) and key not in handled:
                handled.add(key)  # (once: its ranks' requests may all arrive in one poll)
                reason = self._publish(key)
                if reason is not None:
                    failed.append((key, reason))
                else:
                    published.append(key)
            elif kind == "abort":
                self.endpoint.forget([key])
                self.link.ack_abort(key)
                failed.append((key, "the decode side aborted it"))
        return published, failed

    def _pair(self, session_id: str) -> None:
        """Check a registered rank's layout here; its peer is made (the engine reaching it) between the
        endpoint's batches, where its peers and engine are owned."""
        reg = self.link.registrations[session_id]
        try:
            side = self.side_of(reg)
            pair_sides(self.endpoint.side, side)
        except KvplanError as err:
            self.refused[session_id] = f"decode session {session_id} cannot pair with this prefill: {err}"
            log.warning("%s", self.refused[session_id])
            return
        self.refused.pop(session_id, None)
        self.sides[session_id] = side
        k = self.sessions.get(session_id)
        if k is None:  # (its index now: peers are appended between batches in the order their indices were given)
            k = self.sessions[session_id] = self._peers_given
            self._peers_given += 1
        self.endpoint.between_batches(lambda: self._attach(k, session_id, reg, side))

    def _attach(self, k: int, session_id: str, reg: Registration, side: SideMemory) -> None:
        """Make or renew peer ``k`` for a paired rank (between the endpoint's batches)."""
        try:
            name = peer_name(self.endpoint.engine, self.link.backend, reg)
        except Exception as err:  # noqa: BLE001 - the engine's own error (NIXL cannot add the agent)
            self.refused[session_id] = f"decode session {session_id}: the engine cannot reach it: {err}"
            log.warning("%s", self.refused[session_id])
            name, side = None, None  # (the index stays taken: nothing is planned to a peer without a side)
        if k == len(self.endpoint.peers):
            self.endpoint.peers.append(Peer(_StatusOnly(session_id), name=name, side=side, notified=False))
        else:  # registered again (a restarted decode): what it asked for before is gone
            peer = self.endpoint.peers[k]
            peer.name, peer.side = name, side
            peer.lists.clear()
        if side is not None:
            log.info("paired with SGLang decode session %s (attention TP rank %d of %d)", session_id, reg.tp_rank,
                     reg.attn_tp_size)

    def _publish(self, room: int) -> str | None:
        """Record ``room``'s destination lists with its peer; the reason it cannot be served, if so."""
        asked: list[TransferRequest] = list(self.link.requests[room].values())
        refused = [self.refused[r.session_id] for r in asked if r.session_id in self.refused]
        if refused:
            return refused[0]
        live = [r for r in asked if not r.is_dummy]
        if not live:  # nothing of it is this prefill rank's to send (SGLang's dummy ranks): it succeeds as sent
            self.dummies.add(room)
            return None
        if len({r.decode_prefix_len for r in live}) != 1:
            return (f"request {room}: its decode ranks give different decode prefixes "
                    f"{sorted({r.decode_prefix_len for r in live})}")
        parts: dict[tuple[int, int], str] = {}
        published = []
        for req in live:  # each rank the decode's TP spreads the request over: a peer of its own (head slices)
            side = self.sides[req.session_id]
            lists = DestinationLists(np.asarray(req.dst_pages, np.int64),
                                     tuple(np.asarray(ids, np.int64) for ids in req.state_lists))
            try:  # (against the pools that session registered: a bad list fails this request, not a batch)
                check_published(room, lists, int(req.aux_index or 0), side)
            except PoolBoundsError as err:
                return f"request {room}: decode session {req.session_id} published ids outside its pools: {err}"
            part = (side.kv.tp_size, side.kv.tp_rank)
            if part[0] > 1 and part in parts:  # one rank's head slice asked for twice: one of them is not its owner
                return (f"request {room}: decode sessions {parts[part]} and {req.session_id} both ask for the part of "
                        f"TP rank {part[1]} of {part[0]}; nothing of it is sent")
            parts[part] = req.session_id
            published.append((req.session_id, (lists, int(req.aux_index or 0), int(req.decode_prefix_len))))
        self.endpoint.between_batches(lambda: self._take_lists(room, published))
        return None

    def _take_lists(self, room: int, published: list) -> None:
        """Give each peer its lists of ``room`` (between the endpoint's batches); none if one of its ranks
        could not be reached (then the room fails at the next :meth:`progress`, with the reason)."""
        lost = [session for session, _ in published if self.endpoint.peers[self.sessions[session]].side is None]
        if lost:
            self._unserved.append((room, self.refused.get(lost[0], f"decode session {lost[0]} cannot be reached")))
            return
        for session, entry in published:
            self.endpoint.peers[self.sessions[session]].lists[room] = entry

    def report(self, room: int, ok: bool, reason: str | None = None) -> None:
        """Send ``room``'s status to every decode rank that asked for it, then forget the room."""
        try:
            self.link.send_status(room, SUCCESS if ok else FAILED, reason)
        except KvplanError as err:  # a decode rank that is gone finds out by its own checks
            log.warning("could not send request %s's status to its decode rank: %s", room, err)
        self.link.forget(room)
        self.endpoint.forget([room])
        self.dummies.discard(room)

    def close(self) -> None:
        self.link.close()
