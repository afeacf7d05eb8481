"""What a prefill endpoint reads from its decode endpoints (:class:`DecodeMessages`, a part of
:class:`~kvplan.transport.prefill.PrefillEndpoint`): pairings and registrations, published destination lists
(checked against the decode's layout, refused where publishers clash), aborts and refusals, each from the
channel it came on and checked before anything is kept."""

from __future__ import annotations

import logging
import time
from typing import Any, Collection, Mapping, Sequence

from ..errors import KvplanError, LayoutError, PoolBoundsError
from ..planner.device.destinations import check_published, decode_message
from ..planner.contract.pairing import pair_sides
from .control import MAX_REFUSED, ControlChannel, named_request
from .prefill_peers import ACK_S, MAX_PUBLISHERS, Peer, pairing_of, staging_share
from .receiver_plan import receiver_can_plan
from .registration import describe_side, side_from_description, with_model_heads
from .control_messages import Kind

__all__ = ["DecodeMessages"]

log = logging.getLogger(__name__)


def _named(msg: tuple[str, dict[str, Any], list[bytes]]) -> set[Any]:
    """The requests a message names (``request``, or a refusal's ``requests``)."""
    header = msg[1]
    named = header.get("requests") if msg[0] == Kind.REFUSE else [header.get("request")]
    return {r for r in named if isinstance(r, (str, int))} if isinstance(named, list) else set()


class DecodeMessages:
    """The reading half of :class:`~kvplan.transport.prefill.PrefillEndpoint` (its state lives on the endpoint)."""

    def progress(self) -> list[tuple[int, Any]]:
        """Take in, without blocking, whatever the decode endpoints have sent: registrations (paired
        as :meth:`accept` pairs them) and destination lists. Returns the ``(peer, request)`` pairs
        whose lists arrived; a registration that cannot pair is refused and raises ``LayoutError``.
        Aborts the decode endpoints sent are added to :attr:`aborted`.

        With a progress thread (after the first :meth:`submit`), that thread reads the channels and
        this returns what it has read since the last call, at once."""
        if self._thread is None:
            arrived = self._read_channels()
        else:
            if self._thread.errors:
                raise self._thread.errors.popleft()
            arrived = []
            while self._thread.arrived:
                arrived.append(self._thread.arrived.popleft())
        while self._aborts:
            self.aborted.append(self._aborts.popleft())
        return arrived

    def _read_channels(self, busy: Mapping[int, Collection[Any]] | None = None) -> list[tuple[int, Any]]:
        """What :meth:`progress` takes in, read from the channels (the progress thread's, once it runs).
        ``busy``: per peer, the requests with writes of a batch in flight to it. A staged credit goes to
        that peer's moving run; a message that must wait for those writes to end is held, and read in
        order once they have (:meth:`_holds`)."""
        busy = busy or {}
        if self._pairing:
            self._read_pairing()
        arrived = []
        for k, p in enumerate(self.peers):
            moving = busy.get(k, ())
            while p.held and not self._holds(moving, p.held[0], ()):
                self._take(k, p.held.popleft(), arrived)
            while (msg := (p.backlog.popleft() if p.backlog else p.channel.try_recv())) is not None:
                if msg[0] == Kind.WAVE_DONE:
                    self._route_credit(k, msg[1])
                elif self._holds(moving, msg, p.held):
                    p.held.append(msg)
                else:
                    self._take(k, msg, arrived)
            if k not in busy and p.side is not None and not p.dropped and self._peer_gone(k) is not None:
                self._drop(k)
        return arrived

    @staticmethod
    def _holds(moving: Collection[Any], msg: tuple[str, dict[str, Any], list[bytes]], held: Sequence[Any]) -> bool:
        """Whether ``msg`` waits while ``moving`` (a peer's requests with writes in flight) do: an abort or
        refusal of one of them (its acknowledgement is its fence), a registration while any is (it
        re-pairs the peer), and whatever follows a held registration or a held message of the same
        request (they are read in the order they came)."""
        kind = msg[0]
        if kind == Kind.REGISTER:
            return bool(moving) or bool(held)
        named = _named(msg)
        if kind in (Kind.ABORT, Kind.REFUSE) and not named.isdisjoint(moving):
            return True
        return any(h[0] == Kind.REGISTER or not named.isdisjoint(_named(h)) for h in held)

    def _route_credit(self, k: int, header: dict[str, Any]) -> None:
        """A staged credit read off peer ``k``'s channel: its moving run's (one that ended takes none)."""
        for run in self.sending.runs:
            if run.dest == k:
                run.on_credit(header)
                return

    def _take(self, k: int, msg: tuple[str, dict[str, Any], list[bytes]], arrived: list[tuple[int, Any]]) -> None:
        """One message of peer ``k``, taken in."""
        kind, header, frames = msg
        if kind == Kind.REGISTER:
            self._on_register(k, header, frames)
        elif kind == Kind.REQUEST and self.peers[k].side is not None:
            if (request := self._on_request(k, header, frames)) is not None:
                arrived.append((k, request))
        elif kind == Kind.ABORT and (request := named_request(header)) is not None:
            self._on_abort(k, request, str(header.get("reason") or "aborted"))
        elif kind == Kind.REFUSE:
            self._on_refuse(k, header)

    def _refused_by_bound(self, channel: ControlChannel) -> str | None:
        """Why ``channel`` of add_peer is refused (closed, counted): ``max_peers`` taken through add_peer are
        paired or pairing; ``None`` where it may pair."""
        if sum(p.owned and not p.dropped for p in self.peers) + len(self._pairing) < self.max_peers:
            return None
        channel.close()
        self._stats.hit("peers")
        return f"refused a decode endpoint: {self.max_peers} taken through add_peer are paired or pairing (max_peers)"

    def _take_pairing(self, channel: ControlChannel, deadline: float) -> None:
        """(On the progress thread) a channel of add_peer to pair once its registration comes, within the bound."""
        if (refused := self._refused_by_bound(channel)) is not None:
            log.warning("%s", refused)
            return
        self._pairing.append((channel, deadline))

    def _read_pairing(self) -> None:
        """Pair the channels :meth:`add_peer` took on the progress thread whose registration came; close
        those past their deadline. A refused one is closed and raised (the caller's progress() raises it)."""
        now, pairing, self._pairing = time.monotonic(), self._pairing, []
        for i, (channel, deadline) in enumerate(pairing):
            msg = channel.try_recv()
            if msg is None and now <= deadline:
                self._pairing.append((channel, deadline))
            elif msg is None or msg[0] != Kind.REGISTER:
                log.warning("a decode endpoint that connected sent %s within its pairing time: closed",
                            "no registration" if msg is None else f"{msg[0]!r} instead of its registration")
                channel.close()
            else:
                self.peers.append(Peer(channel, owned=True))
                try:
                    self._on_register(len(self.peers) - 1, msg[1], msg[2])
                except BaseException:
                    self.peers.pop()
                    channel.close()
                    self._pairing += pairing[i + 1:]
                    raise

    def _drop(self, k: int) -> None:
        """Decode endpoint ``k`` is gone: forget what it published and what the engine keeps for it
        (measured: a prefill that outlived many decode endpoints kept every one's lists and NIXL
        agent). Its index stays; a restarted endpoint on the same channel registers and pairs again."""
        p = self.peers[k]
        log.warning("decode endpoint %d is gone: dropping its %d requests' lists and its engine connection",
                    k, len(p.lists))
        if p.name is not None:
            self.engine.disconnect(p.name)
        p.lists.clear()
        p.planning.clear()
        p.backlog.clear()
        self._sums.drop([key for key in self._sums.keys() if key[0] == k])
        p.name, p.prepared, p.dropped = None, False, True  # (its layout stays: the planner pairs every peer)
        if p.owned:  # (a listener's channel: a restarted endpoint asks the listener for a new one)
            p.channel.close()

    def _on_abort(self, k: int, request: Any, reason: str) -> None:
        """A decode endpoint aborted ``request``: nothing more of it goes there, and it is told so at
        once ("abort-ack"). The acknowledgement is its fence: ``send`` returns only once every write it
        posted has ended, so when this runs no write into the request's pages is in flight, unless one
        could not be ended (``unsafe``, :func:`~kvplan.transport.engines.base.wait_all`): then the
        acknowledgement says ``fenced: false`` and the decode side must keep the pages out of use.
        One it holds no lists of goes to :attr:`given_up` instead: its decode gave it up before it had
        pages, or after it was sent (the vLLM connector frees the prefill's blocks of the first at once,
        rather than at its deadline)."""
        if request in self.peers[k].lists:
            self._forget_now([request], peer=k)
            self._aborts.append((k, request, reason))
        else:
            self.given_up.append((k, request))
        try:
            self.peers[k].channel.send(Kind.ABORT_ACK, {"request": request, "fenced": request not in self.unsafe},
                                       timeout=ACK_S)
        except KvplanError as err:  # the decode side is gone or stuck: it cannot be told; its pages are its own
            log.warning("request %r: the abort could not be acknowledged: %s", request, err)

    def _on_refuse(self, k: int, header: dict[str, Any]) -> None:
        """A decode endpoint refused requests it never published (``DecodeEndpoint.refuse_all``, an
        admission bound there): each goes to :attr:`refused` and :attr:`given_up`, unacknowledged, since
        no page of them exists. One it did publish here is taken as aborted (acknowledged, its fence)."""
        requests, reason = header.get("requests"), str(header.get("reason") or "refused")
        if not isinstance(requests, list):
            return
        for request in requests[:MAX_REFUSED]:
            request = named_request({"request": request})
            if request is None:
                continue
            if request in self.peers[k].lists:
                self._on_abort(k, request, reason)
            else:
                self.given_up.append((k, request))
                self.refused.append((k, request, reason))

    def _on_register(self, k: int, header: dict[str, Any], frames: list[bytes]) -> None:
        """Pair with decode endpoint ``k`` from its registration; one that is malformed or cannot pair
        is refused (told so, with the reason) and raises :class:`~kvplan.errors.LayoutError`."""
        peer = self.peers[k]
        if peer.side is not None and not peer.dropped:  # registered again: a new endpoint, or one paired anew
            self._drop(k)  # (nothing the one before published is sent to it)
        try:
            if self.compat is not None and header.get("compat") != self.compat:
                raise LayoutError(f"the decode side's KV bytes are {header.get('compat')!r}, this side's "
                                  f"{self.compat!r}: they would land scrambled")
            peer_side = with_model_heads(side_from_description(header["side"]), self.side.kv.num_kv_heads)
            pair_sides(self.side, peer_side)
            staging = staging_share(header.get("staging"))
            index_there = header.get("peer")
            if index_there is not None and (not isinstance(index_there, int) or index_there < 0):
                raise LayoutError(f"the registration names this sender by {index_there!r}, not an index")
            if not frames:
                raise LayoutError("the registration carries no engine metadata")
        except (LayoutError, KeyError, TypeError, ValueError, OverflowError) as err:
            why = str(err) if isinstance(err, LayoutError) else f"a malformed registration ({type(err).__name__}: {err})"
            peer.channel.send(Kind.REFUSED, {"reason": why})
            raise LayoutError(f"decode endpoint {k}: {why}") from err
        peer.side, peer.dropped = peer_side, False
        peer.pairing = pairing_of(peer.channel)
        self._touched.discard(k)  # (a decode that registers again is a new one: nothing of this side's is there)
        peer.plannable = receiver_can_plan(self.side, peer_side, self.policy)
        peer.staging = staging
        peer.index_there = index_there
        peer.integrity = header.get("integrity") is True
        peer.name = self.engine.connect(frames[0])
        # this side's layout: a decode rank that gathers from several source ranks checks their ranks with it
        # (its engine's name: the receiver checks that a section's notification comes from the sender of its request)
        # with no batch moving, no write is in flight but those that could not be ended: without one, nothing
        # this side wrote before can still land (a decode that lost this side to its silence fences on this word)
        paired: dict[str, Any] = {"from": self.id, "side": describe_side(self.side), "engine": self.engine.name,
                                  "writes_ended": not self.unsafe and not self.writes_in_flight()}
        peer.credits_by_engine = bool(header.get("notifies")) and self.engine.capabilities.notifies
        if peer.credits_by_engine:  # its credits come back through the engine, to this side's metadata
            paired["credits"] = "engine"
            peer.channel.send(Kind.PAIRED, paired, self.engine.metadata())
        else:
            peer.channel.send(Kind.PAIRED, paired)
        self._warm_peers(timeout=ACK_S * 4)  # (after warm_up: each peer that pairs later is warmed as it pairs)

    def _on_request(self, k: int, header: dict[str, Any], frames: list[bytes]) -> Any:
        """Keep a request's destination lists from decode endpoint ``k``; its name, or ``None`` where the
        message is malformed (then the request, if it has a usable name, is answered ``failed``)."""
        p = self.peers[k]
        request = named_request(header)
        try:
            if request is None:
                raise ValueError(f"it names no request ({header.get('request')!r})")
            prefix_len = header["prefix_len"]
            if not isinstance(prefix_len, int) or prefix_len < 0:
                raise ValueError(f"its prefix length is {prefix_len!r}")
            lists, aux = decode_message(frames[0], len(p.side.state))
            check_published(request, lists, aux, p.side)
        except (KvplanError, KeyError, IndexError, TypeError, ValueError, OverflowError) as err:
            why = (f"its destination lists name ids outside the pools its decode endpoint registered: {err}"
                   if isinstance(err, PoolBoundsError) else
                   f"its destination lists are malformed ({type(err).__name__}: {err})")
            if request is not None:
                self._report(k, request, why)
            else:
                log.warning("decode endpoint %d sent destination lists this side cannot use: %s", k, why)
            return None
        publishers = header.get("publishers", 1)
        if not isinstance(publishers, int) or isinstance(publishers, bool) or not 1 <= publishers <= MAX_PUBLISHERS:
            self._stats.hit("publishers")
            self._report(k, request, f"it names {publishers!r} publishers (1 to {MAX_PUBLISHERS})")
            return None
        if request not in p.lists and len(p.lists) >= self.max_published:
            self._stats.hit("published")
            self._report(k, request, f"refused: its decode endpoint has {len(p.lists)} requests published here and "
                                     "not yet sent (max_published); nothing of it is sent")
            return None
        clash = self._publication_clash(k, request, publishers)
        if clash is not None:
            self._refuse_publication(k, request, clash)
            return None
        p.lists[request] = (lists, aux, prefix_len)
        if publishers > 1:
            self.publishers[request] = publishers
        if header.get("plans"):
            p.planning.add(request)
        return request

    def _publication_clash(self, k: int, request: Any, publishers: int) -> str | None:
        """Why decode endpoint ``k``'s publication of ``request`` cannot stand beside the others' (``None``
        where it can). Every publisher names the same count, no more publish it than that, and where the
        layouts split the KV by rank no two publish the same rank's part: one that publishes another's
        request must not receive its bytes, nor hold it back by overstating the count."""
        others = [j for j, q in enumerate(self.peers) if j != k and request in q.lists]
        if not others:
            return None
        counted = self.publishers.get(request, 1)
        if publishers != counted:
            return f"decode endpoints {others} publish it as one of {counted}, endpoint {k} as one of {publishers}"
        if len(others) + 1 > counted:
            return f"decode endpoints {others} and {k} publish it: more than the {counted} it is split over"
        kv = self.peers[k].side.kv
        same = [j for j in others if kv.tp_size > 1 and (self.peers[j].side.kv.tp_size, self.peers[j].side.kv.tp_rank)
                == (kv.tp_size, kv.tp_rank)]
        if same:
            return f"decode endpoints {same} and {k} publish the same part of it (TP rank {kv.tp_rank} of {kv.tp_size})"
        return None

    def _refuse_publication(self, k: int, request: Any, clash: str) -> None:
        """A request published in a way that cannot stand (:meth:`_publication_clash`): nothing of it is
        sent, and every endpoint that published it here is told it failed."""
        self._stats.hit("publication clash")
        involved = [j for j, q in enumerate(self.peers) if request in q.lists] + [k]
        self._forget_now([request])
        for j in involved:
            self._report(j, request, f"refused: {clash}; nothing of it is sent")
