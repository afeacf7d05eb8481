"""The control channel's handshake (:class:`Handshake`, a part of :class:`~.control.ControlChannel`): each
end's hello with a fresh nonce, the proof over the other's, and, on a bound end, the connections that
wait to become its peer (the first whose proof verifies). :mod:`.control` says what the protocol is;
:mod:`.auth` computes its codes."""

from __future__ import annotations

import hmac
import json
import logging
import math
import time
from typing import Any

from .auth import message_code, nonce, pairing_key, proof
from .control_wire import MARK, ControlTimeout, SecretMismatch, parse_parts

__all__ = ["Handshake"]

log = logging.getLogger(__name__)


class Handshake:
    """The handshake's half of :class:`~.control.ControlChannel` (its state lives on the channel)."""

    def _hello(self) -> dict[str, Any]:
        """This side's hello: its nonce, and whether it holds a secret. The flag only names why two ends
        cannot pair (nothing is trusted on it: a pairing still needs the proofs)."""
        return {"nonce": self._my_nonce, "secret": self.secret is not None}

    def _secret_state(self, header: dict[str, Any]) -> str | None:
        """Why a peer whose hello is ``header`` cannot pair with this side by its secret flag, else ``None``
        (a peer that does not say is judged by its proof alone)."""
        theirs = header.get("secret")
        if not isinstance(theirs, bool) or theirs == (self.secret is not None):
            return None
        return "peer requires a secret" if theirs else "peer has no secret"

    def _mismatch_error(self, why: str) -> SecretMismatch:
        advice = {"secret mismatch": "both sides hold a secret and they differ",
                  "peer requires a secret": "the peer holds a secret and this side none",
                  "peer has no secret": "this side holds a secret and the peer none"}[why]
        return SecretMismatch(f"{why}: the channel on {self.host} port {self.port} cannot pair ({advice}); give every "
                              "node the same KVPLAN_SECRET or KVPLAN_SECRET_FILE")

    def _greet(self) -> None:
        """(connecting) Send this side's hello once a peer can take it, and again every ``RESEND_S`` until the
        peer's proof has verified (a bound end answers only once no other peer's connection stands; never waits)."""
        if self._bound:
            return
        # the connection's events (at most once a look period): after a loss, the connection made again is read
        # here and greeted at once, also on a channel that had paired
        self.peer_gone()
        if self._authed:
            return
        if self._hello_sent and time.monotonic() - self._hello_at < self.RESEND_S:
            return
        if self.socket.poll(0, self._zmq.POLLOUT):
            try:
                self._out("_hello", self._hello(), (), time.monotonic(), 0.0)
                self._hello_sent, self._hello_at = True, time.monotonic()
            except ControlTimeout:
                pass

    def _shake_hands(self, deadline: float, kind: str, wait_s: float) -> None:
        """Take messages until this side may send: a connecting end sends its hello and waits for the peer's
        (both nonces make the pairing's key; it takes the peer's messages only once the peer has proved the
        secret); a bound end waits for a connection that has proved it. Or the deadline."""
        # (a connecting end waits for the peer's proof too, which comes with its hello: nothing leaves for a
        # peer that has not proved the secret, and a mismatch is named at once)
        while (self._key is None or not self._authed) if not self._bound else (self._gone or not self._authed):
            if self._mismatch is not None and not self._bound:  # (its one peer cannot pair: no use waiting)
                raise self._mismatch_error(self._mismatch)
            if not self._bound:
                # (again every RESEND_S: a hello sent into a connection that was then dropped is lost; ZeroMQ
                # connects again by itself)
                self._greet()
            left = deadline - time.monotonic()
            if self.socket.poll(max(0, min(self.SLICE_MS, round(1000 * left)))):
                self._keep(self._take(*self._read()))
                continue
            self.peer_gone()  # (reads the connection's events; a loss before the pairing is waited out)
            if left <= 0:
                if self._mismatch is not None:  # (a bound end: a candidate that could not pair, the last one's why)
                    raise self._mismatch_error(self._mismatch)
                why = ("its proof of the shared secret was refused (a secret on one side only, or another one)"
                       if self._proof_refused else "it did not answer the handshake")
                raise ControlTimeout(f"the peer of the channel on {self.host} port {self.port} did not pair within "
                                     f"{round(wait_s * 1000)} ms, so a {kind!r} message cannot leave: {why}")

    def _read(self) -> tuple[bytes | None, int | None, list[bytes]]:
        """One message off the socket: on a bound end, with the routing id and descriptor of the connection it
        came on (``None`` on a connecting end, which has one)."""
        frames = self.socket.recv_multipart(copy=False)
        if not self._bound:
            return None, None, [frame.bytes for frame in frames]
        fd = None
        if len(frames) > 1:
            try:
                fd = frames[1].get(self._zmq.SRCFD)
            except self._zmq.ZMQError:
                fd = None
        return frames[0].bytes, fd, [frame.bytes for frame in frames[1:]]

    def _refuse(self, why: str) -> None:
        self.refused += 1
        log.warning("refused a message on the control channel on %s port %d: %s", self.host, self.port, why)

    def _take(self, rid: bytes | None, fd: int | None, parts: list[bytes]) -> tuple[str, dict[str, Any], list[bytes]] | None:
        """A received message opened: its handshake steps done here, an owner's message returned once it
        is checked; ``None`` for the first and for what is refused."""
        try:
            if len(parts) < 5 or parts[0] != MARK:
                raise ValueError("not a kvplan control message")
            envelope = json.loads(parts[1])
            sender, receiver, seq = envelope["f"], envelope["t"], envelope["s"]
            if not (isinstance(sender, str) and isinstance(receiver, str) and type(seq) is int):
                raise ValueError("a malformed envelope")
            kind = parts[3].decode()
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            if self._bound and rid != self._peer_rid:  # (a stranger's: quietly, see _from_candidate)
                self.strangers += 1
                log.debug("refused a message on the control channel on %s port %d from a connection that is not "
                          "its peer's: %s", self.host, self.port, err)
            else:
                self._refuse(str(err))
            return None
        if self._bound and rid != self._peer_rid:
            self._from_candidate(rid, fd, kind, sender, receiver, seq, parts)
            return None
        if kind == "_hello":
            self._on_hello(rid, fd, sender, parts)
            return None
        if kind == "_proof":
            if not self._bound:
                self._on_proof(sender, receiver, seq, parts)
            return None  # (a bound end's peer has proved already: the same proof again)
        if not self._authed or sender != self._peer_inc or receiver != self.incarnation:
            self._refuse(f"a {kind!r} message from incarnation {sender!r} to {receiver!r}, not of this pairing "
                         f"({self._peer_inc!r} to {self.incarnation!r}{'' if self._authed else ', not paired yet'})")
            return None
        if seq <= self._recv_seq:
            self._refuse(f"a {kind!r} message out of sequence ({seq} after {self._recv_seq}): a replay")
            return None
        if self.secret is not None and not hmac.compare_digest(parts[2], message_code(self._key, parts[1], parts[3:])):
            self._refuse(f"a {kind!r} message whose code does not verify under the pairing's key")
            return None
        self._recv_seq = seq
        return parse_parts(parts[3:])

    def _on_hello(self, rid: bytes | None, fd: int | None, sender: str, parts: list[bytes]) -> None:
        """A hello on the peer's connection: the other end's (a connecting end's), or the bound end's peer
        starting a new pairing on the same connection."""
        kind, header, _ = parse_parts(parts[3:])
        challenge = header.get("nonce")
        if not isinstance(challenge, str) or not challenge:
            self._refuse("a hello without a nonce")
            return
        if self._mirrored(challenge):
            self._refuse(f"a hello from incarnation {sender!r} with this side's own nonce: a reflection")
            return
        if not self._bound and self._secret_state(header) is not None:
            self._mismatch = self._secret_state(header)
            self._refuse(f"{self._mismatch}: incarnation {sender!r} cannot pair with this side")
            return
        if challenge == self._peer_nonce and sender == self._peer_inc:
            # the same hello again: what this side answered was lost (a connection made again), or is on
            # its way; answered again at most every RESEND_S
            if time.monotonic() - self._answered >= self.RESEND_S:
                self._answer(sender, challenge, hello=True, to=None if rid is None else (rid, sender))
            return
        if self._bound:  # (a new pairing on the peer's connection: it is made as any connection's is)
            self._from_candidate(rid, fd, "_hello", sender, self.incarnation, 0, parts, renewed=True)
            return
        # the connection this hello came on was made before it came: its events are read now, so that one read
        # later is a later connection's (read late, a connection's own event would end the pairing it made)
        self._looked = 0.0
        self.peer_gone()
        if self._peer_inc is not None:  # a new pairing in place of one: a restarted process, or a new channel
            log.warning("control channel on %s port %d: a new pairing (incarnation %s) in place of incarnation %s",
                        self.host, self.port, sender, self._peer_inc)
            if not self._reconnected:  # (a connection made again has said so already)
                self._replaced = True
        self._pairing_reset(sender)
        self._peer_nonce = challenge
        self._key = pairing_key(self.secret or b"", (self.incarnation, self._my_nonce), (sender, challenge))
        self._answer(sender, challenge, hello=not self._hello_sent)

    def _answer(self, sender: str, challenge: str, hello: bool, to: tuple[bytes, str] | None = None) -> None:
        """This side's hello (where asked) and its proof for ``challenge``, waiting at most 0.2 s to send."""
        self._answered = time.monotonic()
        deadline, wait_s = self._answered + 0.2, 0.2
        try:
            if hello:
                self._out("_hello", self._hello(), (), deadline, wait_s, to)
                self._hello_sent = True
            self._out("_proof", {"proof": self._proof_for(sender, challenge)}, (), deadline, wait_s, to)
        except ControlTimeout as err:
            log.warning("control channel on %s port %d: the handshake could not be answered: %s", self.host,
                        self.port, err)

    def _on_proof(self, sender: str, receiver: str, seq: int, parts: list[bytes]) -> None:
        _, header, _ = parse_parts(parts[3:])
        if sender != self._peer_inc or receiver != self.incarnation or self._peer_nonce is None:
            self._refuse(f"a proof from incarnation {sender!r} to {receiver!r}, not of this handshake")
            return
        if not self._proved(sender, header, self._peer_nonce):
            self._proof_refused = True
            self._mismatch = self._mismatch or "secret mismatch"
            self._refuse(f"secret mismatch: incarnation {sender!r} did not prove the shared secret")
            return
        self._authed, self._recv_seq, self._nonce_used = True, seq, True
        self._reconnected = False

    def _proof_for(self, verifier: str, challenge: str) -> str:
        """This side's proof for ``verifier``'s nonce ``challenge``, naming this side's role and nonce."""
        return proof(self.secret or b"", self._role(), self.incarnation, verifier, self._my_nonce, challenge)

    def _role(self, peer: bool = False) -> str:
        """This side's role in a proof (``peer``: its peer's, the other one)."""
        return "bound" if self._bound != peer else "connecting"

    def _proved(self, sender: str, header: dict[str, Any], their_nonce: str) -> bool:
        expected = proof(self.secret or b"", self._role(peer=True), sender, self.incarnation, their_nonce, self._my_nonce)
        given = header.get("proof")
        return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())

    def _mirrored(self, challenge: str) -> bool:
        """Whether a hello names this side's own nonce: no peer does (every nonce is fresh), so it is this side's
        own words sent back at it. (Its own incarnation is no sign: two channels of one process pair, as the
        tests and an in-process hand-off do; the proofs' roles keep those apart.)"""
        return challenge == self._my_nonce

    # -- a bound end's connections -------------------------------------------------------------------
    def _peer_stands(self) -> bool:
        return self._peer_rid is not None and self._authed and not self._gone

    def _from_candidate(self, rid: bytes, fd: int | None, kind: str, sender: str, receiver: str, seq: int,
                        parts: list[bytes], renewed: bool = False) -> None:
        """(bound) A message on a connection that is not the peer's: a hello makes it a candidate (answered
        once no peer's connection stands), a candidate's valid proof makes it the peer; anything else is a
        stranger's, refused. Quietly: anyone who reaches the port can send."""
        if kind == "_hello":
            _, header, _ = parse_parts(parts[3:])
            challenge = header.get("nonce")
            if isinstance(challenge, str) and challenge and self._secret_state(header) is not None:
                # never a candidate: it cannot pair. Once per connection, it is told this side's hello (so that
                # it names why at once) and the refusal is logged; the last one's why is named at the deadline
                self._mismatch = self._secret_state(header)
                if rid not in self._mismatched:
                    self._refuse(f"{self._mismatch}: incarnation {sender!r} cannot pair with this side")
                    try:
                        self._out("_hello", self._hello(), (), time.monotonic(), 0.0, (rid, sender))
                    except ControlTimeout:
                        pass
                self._mismatched[rid] = None
                while len(self._mismatched) > self.MAX_CANDIDATES:
                    self._mismatched.pop(next(iter(self._mismatched)))
                return
            if isinstance(challenge, str) and challenge and self._mirrored(challenge):
                self.strangers += 1  # (quietly, as a stranger's: anyone who reaches the port can send)
                log.debug("refused a hello on the control channel on %s port %d with its own nonce",
                          self.host, self.port)
                return
            if isinstance(challenge, str) and challenge:
                self._looked = 0.0
                self.peer_gone()  # (earlier connections' events first: one closed may have had this one's number)
                known = self._candidates.pop(rid, None)
                answered = known[3] if known is not None and known[1:3] == [sender, challenge] else 0.0
                self._candidates[rid] = [fd, sender, challenge, answered]
                while len(self._candidates) > self.MAX_CANDIDATES:
                    self._candidates.popitem(last=False)
                if renewed:  # (the peer's own connection begins a new pairing: the old one is over)
                    self._peer_rid, self._authed = None, False
                self._answer_candidates()
                if self.secret is None and not self._peer_stands() and self._candidates.get(rid, [0, 0, 0, 0])[3]:
                    # without a secret anyone can prove, and a proof adds nothing: the first hello answered is the
                    # peer at once, and this side may send before the other end has read a thing (with a secret
                    # the two ends must be served at once: docs/failures.md §10)
                    self._adopt(rid, fd, sender, challenge, seq)
                return
        elif kind == "_proof" and rid in self._candidates:
            fd, candidate, challenge, answered = self._candidates[rid]
            _, header, _ = parse_parts(parts[3:])
            if 0 < answered < math.inf and sender == candidate and receiver == self.incarnation and not self._peer_stands():
                if self._proved(sender, header, challenge):
                    self._adopt(rid, fd, sender, challenge, seq)
                    return
                self._proof_refused = True
                self._mismatch = "secret mismatch"
                # (kept, never answered again: the same hello again, as its sender repeats it, costs nothing)
                self._candidates[rid][3] = math.inf
                self._refuse(f"secret mismatch: incarnation {sender!r} did not prove the shared secret")
                return
        self.strangers += 1
        log.debug("refused a %r message on the control channel on %s port %d: not from its peer's connection",
                  kind, self.host, self.port)

    def _answer_candidates(self) -> None:
        """(bound) Answer every candidate's hello while no peer's connection stands (again at most every
        ``RESEND_S``): the first whose proof verifies is the peer. A fresh nonce once a pairing has used one."""
        if self._peer_stands() or not self._candidates:
            return
        if self._nonce_used:
            self._my_nonce, self._nonce_used = nonce(), False
        now = time.monotonic()
        for rid, candidate in list(self._candidates.items()):
            fd, sender, challenge, answered = candidate
            if now - answered < self.RESEND_S:
                continue
            candidate[3] = now
            try:
                self._out("_hello", self._hello(), (), now, 0.0, (rid, sender))
                self._out("_proof", {"proof": self._proof_for(sender, challenge)}, (), now, 0.0, (rid, sender))
            except ControlTimeout:  # (its connection is gone)
                self._candidates.pop(rid, None)

    def _adopt(self, rid: bytes, fd: int | None, sender: str, challenge: str, seq: int) -> None:
        """(bound) The candidate on ``rid`` proved the secret: its connection is the peer's from now on."""
        if self._peer_inc is not None and self._peer_inc != sender:
            log.warning("control channel on %s port %d: a new pairing (incarnation %s) in place of incarnation %s",
                        self.host, self.port, sender, self._peer_inc)
        mine = self._my_nonce
        self._pairing_reset(sender)
        self._my_nonce, self._hello_sent, self._nonce_used = mine, True, True
        self._peer_nonce = challenge
        self._key = pairing_key(self.secret or b"", (self.incarnation, mine), (sender, challenge))
        self._authed, self._recv_seq, self._answered = True, seq, time.monotonic()
        self._candidates.clear()  # (they said hello to a pairing that is over: they say it again if they are peers)
        self._peer_rid, self._peer_fd = rid, fd if fd is not None and fd in self._open else None
        self._replaced = self._replaced or self._ever
        self._ever, self._connected, self._gone = True, True, False
        self._watch(self._peer_fd)
