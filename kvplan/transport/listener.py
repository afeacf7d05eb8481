"""A known port where decode endpoints ask for a control channel of their own.

A :class:`ControlChannel` has one peer. A prefill endpoint that serves several
decode endpoints through one advertised port (an SGLang bootstrap port) binds a
:class:`ChannelListener` there. Each decode endpoint sends it one ``hello`` (:func:`channel_via`);
the listener binds a new channel on an ephemeral port of the same host and answers with that port;
the decode endpoint connects its own channel to it. Every wait has a deadline.

A channel handed out is *pending* until its decode endpoint has paired on it (the control channel's
handshake, with the shared secret where one is set) and its first message (its registration) has
arrived: :meth:`ChannelListener.accept_pending` returns only such channels, so pairing never blocks
the caller's loop on a peer that said hello and nothing more, and a process that cannot prove the
secret never gets past this. A pending channel not ready within ``handshake_s`` is closed; at most
``max_pending`` are open at once, and at most ``max_pending_per_source`` for one source address. A hello
beyond either makes room by closing the oldest pending channel of its own source, else of the source
that holds the most: hellos from a broken or hostile peer cost a bounded number of sockets for a bounded
time, and however many sources say hello and go silent, a decode that pairs within the time the others
take to fill the slots again is answered and pairs.

Before anything is proved, the listening port holds little for anyone: a frame above ``MAX_HELLO_BYTES``
disconnects its sender (a hello is a few bytes), a connection that has not finished ZeroMQ's handshake
within ``handshake_s`` is closed, and every connection is ended ``handshake_s`` after it was accepted,
and beyond ``max_connections`` open at once the oldest first (:mod:`.listener_connections`): a
listener's connection carries one hello and its answer.

Example::

    listener = ChannelListener(bind_port=8998, host="127.0.0.1")   # prefill (loopback: the example's choice)
    channel = channel_via("127.0.0.1", 8998, timeout=5)  # decode: its own channel
    new = listener.accept_pending()                     # prefill: [ControlChannel], each with a message to read
"""

from __future__ import annotations

import errno
import json
import logging
import time

from ..errors import KvplanError, PeerError
from .auth import channel_secret
from .control import ControlChannel, ControlTimeout
from .listener_connections import ConnectionBound
from .zmq_import import require_zmq

__all__ = ["AddressInUse", "ChannelListener", "channel_via"]

log = logging.getLogger(__name__)


class AddressInUse(KvplanError, OSError):
    """The address a listener was asked to bind is taken (another process, or another engine of this host
    given the same port)."""


class ChannelListener:
    """A ROUTER socket on ``host:bind_port`` (0: an ephemeral port, in ``port``) that answers each
    ``hello`` with a new channel's port (its channels use ``secret``, else the one
    :func:`.auth.channel_secret` finds, resolved here: a listener off loopback with no secret and no
    ``insecure`` opt-out does not start)."""

    MAX_HELLO_BYTES = 4096  # the largest frame the listening port takes (a hello is a few bytes)

    def __init__(self, bind_port: int, *, host: str, peer_timeout: float = 1.0, handshake_s: float = 5.0,
                 max_pending: int = 64, max_pending_per_source: int = 8, max_connections: int = 256,
                 secret: bytes | None = None, insecure: bool = False):
        zmq = require_zmq()
        self._zmq = zmq
        self.host, self.peer_timeout = host, peer_timeout
        self.secret = channel_secret(host, secret, insecure=insecure)
        self.handshake_s, self.max_pending, self.max_pending_per_source = handshake_s, max_pending, max_pending_per_source
        # channels handed out, not yet ready: (channel, deadline, the source address whose hello it answered)
        self.pending: list[tuple[ControlChannel, float, str]] = []
        self.refused_busy = 0  # hellos answered "busy" (no channel could be opened), over the listener's life
        self.evicted = 0  # pending channels closed to make room for a newer hello, over the listener's life
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.setsockopt(zmq.MAXMSGSIZE, self.MAX_HELLO_BYTES)
        self.socket.setsockopt(zmq.HANDSHAKE_IVL, max(1, round(handshake_s * 1000)))
        if bind_port:
            try:
                self.socket.bind(f"tcp://{host}:{bind_port}")
            except zmq.ZMQError as err:
                self.socket.close(0)
                if err.errno == errno.EADDRINUSE:
                    raise AddressInUse(f"{host}:{bind_port} is taken: another process listens there ({err})") from None
                raise
            self.port = bind_port
        else:  # an ephemeral port, bound at once (tests, or a port handed out some other way)
            self.port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.connections = ConnectionBound(zmq, self.socket, self.port, max_connections, handshake_s)

    def accept_pending(self) -> list[ControlChannel]:
        """The channels handed out whose decode endpoint has sent its first message (never blocks):
        the caller reads it at once. Answers every ``hello`` that has arrived with a new channel's
        port (up to ``max_pending`` waiting at once; beyond, the oldest of the source that crowds the others is
        closed); closes a channel whose first message has not come within ``handshake_s``, and the
        listening port's connections past their bounds. A malformed message is answered with an error."""
        self.connections.step(time.monotonic())
        self._answer_hellos()
        now, ready, waiting = time.monotonic(), [], []
        for channel, deadline, source in self.pending:
            if channel.advance():
                ready.append(channel)
            elif now > deadline:
                log.warning("closed the channel on port %d: the decode endpoint at %s that asked for it did not pair "
                            "and register within %.1f s", channel.port, source, self.handshake_s)
                channel.close()
            else:
                waiting.append((channel, deadline, source))
        self.pending = waiting
        return ready

    def _answer_hellos(self) -> None:
        while self.socket.poll(0):
            frames = self.socket.recv_multipart(copy=False)
            who, body = frames[0].bytes, frames[-1].bytes
            try:
                source = frames[-1].get("Peer-Address")
            except Exception:  # noqa: BLE001 - a transport without the property (ipc): one source
                source = "?"
            try:
                kind = json.loads(body).get("kind")
            except (ValueError, AttributeError):
                kind = None
            if kind != "hello":
                log.warning("ignored a malformed message on the listening port %d", self.port)
                self.socket.send_multipart([who, json.dumps({"error": "expected a hello"}).encode()])
                continue
            self._make_room(source)
            try:
                channel = ControlChannel(peer_timeout=self.peer_timeout, host=self.host, secret=self.secret,
                                         insecure=self.secret is None)
            except self._zmq.ZMQError as err:  # (out of sockets or ports: this hello waits, the listener lives on)
                self.refused_busy += 1
                log.error("could not open a channel for a hello from %s on port %d: %s", source, self.port, err)
                self.socket.send_multipart([who, json.dumps({"error": f"busy: no channel could be opened ({err})"}).encode()])
                continue
            self.socket.send_multipart([who, json.dumps({"port": channel.port}).encode()])
            self.pending.append((channel, time.monotonic() + self.handshake_s, source))

    def _make_room(self, source: str) -> None:
        """Close the oldest pending channel of ``source`` where it holds its bound, else, where all are taken, the
        oldest of the source that holds the most (a hello is always answered; what waits longest to pair,
        among those that crowd the others, gives way)."""
        counts: dict[str, int] = {}
        for _, _, asker in self.pending:
            counts[asker] = counts.get(asker, 0) + 1
        if counts.get(source, 0) >= self.max_pending_per_source:
            crowding = source
        elif len(self.pending) >= self.max_pending:
            crowding = max(counts, key=counts.__getitem__)
        else:
            return
        at = next(k for k, (_, _, asker) in enumerate(self.pending) if asker == crowding)
        channel, _, _ = self.pending.pop(at)
        channel.close()
        self.evicted += 1
        # (a flood is logged, not a line per hello: the 1st, 2nd, 4th, 8th ... time)
        level = logging.WARNING if self.evicted & (self.evicted - 1) == 0 else logging.DEBUG
        log.log(level, "closed a channel on port %d that %s asked for and has not paired on, for a hello from %s: %d "
                "channels waited to pair, %d of them asked from %s (%d closed so)", self.port, crowding, source,
                len(self.pending) + 1, counts[crowding], crowding, self.evicted)

    def close(self) -> None:
        for channel, _, _ in self.pending:
            channel.close()
        self.pending = []
        self.connections.close()
        self.socket.close()


def channel_via(host: str, port: int, timeout: float, peer_timeout: float = 1.0,
                secret: bytes | None = None, insecure: bool = False) -> ControlChannel:
    """Ask the :class:`ChannelListener` on ``host:port`` for a channel of its own and connect it (with
    ``secret``, else the one :func:`.auth.channel_secret` finds, resolved before anything is sent);
    :class:`ControlTimeout` if no answer comes within ``timeout`` seconds."""
    secret = channel_secret(host, secret, insecure=insecure)
    zmq = require_zmq()
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(f"tcp://{host}:{port}")
        deadline = time.monotonic() + timeout
        if not socket.poll(max(0, int(timeout * 1000)), zmq.POLLOUT):
            raise ControlTimeout(f"the listener on {host}:{port} did not take a hello within {timeout} s")
        socket.send_multipart([json.dumps({"kind": "hello"}).encode()], zmq.NOBLOCK)
        if not socket.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            raise ControlTimeout(f"no channel from the listener on {host}:{port} within {timeout} s")
        answer = json.loads(socket.recv_multipart()[-1])
        if not isinstance(answer, dict) or not isinstance(answer.get("port"), int):
            raise PeerError(f"the listener on {host}:{port} answered {answer!r}, not a port")
        return ControlChannel(connect_port=int(answer["port"]), host=host, peer_timeout=peer_timeout, secret=secret,
                              insecure=secret is None)
    finally:
        socket.close()
