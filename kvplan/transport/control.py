"""The control path between a decode and a prefill endpoint: ZeroMQ ROUTER and DEALER sockets on the caller's address.

Messages are multipart: a kind, a JSON header, then binary frames (engine metadata, index-list
messages in SGLang's wire format, descriptor tables). Every receive has a deadline.

On the wire each message goes in an envelope: a mark, the sender's and the receiver's incarnation and a
sequence number, and (with a shared secret) an HMAC-SHA256 over all of it. The two ends shake hands
(:mod:`.auth`): each sends a hello with a fresh nonce (a connecting end when its connection is made, a
bound end in answer to a connection's hello), then a proof over the other's; a bound end's peer is the
first connection whose proof verifies. A side sends a pairing's first
message once it has the peer's hello, and takes the peer's messages only once the peer's proof has
verified; a message from any other incarnation, one out of sequence, or one whose code does not verify
is refused and logged, never returned. The handshake happens inside :meth:`ControlChannel.send` and the
receiving calls: an owner sees only its own messages.

The channel is one class in three files: this one (sockets, sending and receiving), its handshake
(:mod:`.control_handshake`) and its peer's liveness (:mod:`.control_liveness`); what both ends agree on
the wire is in :mod:`.control_wire`.
"""

from __future__ import annotations

import socket as pysocket
import json
import logging
import time
from collections import OrderedDict, deque
from typing import Any

from .zmq_import import require_zmq
from . import auth
from .auth import channel_secret, message_code, nonce
from .control_handshake import Handshake
from .control_liveness import Liveness
from .control_wire import MARK, MAX_REFUSED, ControlTimeout, monitor_numbers, named_request
from .note_seal import NoteSeal

__all__ = ["ControlChannel", "ControlTimeout", "MAX_REFUSED", "named_request"]

log = logging.getLogger(__name__)


class ControlChannel(Handshake, Liveness):
    """One end of a control connection; the decode side binds an ephemeral port (or ``bind_port``), the
    prefill side connects (either end may bind: the SGLang adapter binds the prefill's bootstrap port).

    A bound end is a ROUTER socket and a connecting end a DEALER: anyone who reaches the port can connect,
    and a bound end tells its connections apart by ZeroMQ's routing ids. Its peer is the one connection
    that has proved the shared secret in the handshake (:mod:`.auth`; without a secret, the first to shake
    hands); while that connection stands no other is answered, and what the others send is refused. Once
    it is lost, the next connection to shake hands is the peer (a restarted process connecting to the same
    port): :meth:`replaced` says when that happened, so that the owner can pair again. (Not a PAIR socket:
    libzmq 4.3.5 aborts the process when a second ZeroMQ peer connects to a PAIR socket that holds one,
    sends and closes, "Assertion failed: !_io_error (src/stream_engine_base.cpp:310)"; a ROUTER keeps
    every connection and has no such path.)

    ZeroMQ's own heartbeats run both ways (every 0.2 s; a peer silent for ``peer_timeout`` seconds
    is dropped; they are answered by ZeroMQ's I/O thread, so a peer whose owner is busy, however many
    messages wait for it, is not silent: its receive queue has no bound), and a monitor watches the
    connections: :meth:`peer_gone` turns true within about ``peer_timeout`` of the peer dying or hanging,
    and at once when its process exits. Messages still queued at :meth:`close` get a second to leave (a
    final ``failed`` must not be lost).

    The monitor is read at most every ``LOOK_S`` seconds: the transport's loops ask on every turn,
    and a turn that reads it costs several times one that does not (a streamed send's last group is
    noticed and posted from such a loop; docs/layerwise.md §3).

    ``secret``: the shared secret of the handshake and the message codes (``None``: ``KVPLAN_SECRET`` or
    ``KVPLAN_SECRET_FILE``, else on loopback this user's loopback secret, else :class:`~kvplan.errors.SettingError`;
    :func:`.auth.channel_secret`). ``insecure``: with no secret configured, run open instead (logged and
    counted; ``KVPLAN_INSECURE`` does the same); docs/failures.md §10.

    Example::

        bound = ControlChannel(host="127.0.0.1", secret=b"from-the-deployment")
        peer = ControlChannel(bound.port, host="127.0.0.1", secret=b"from-the-deployment")
        peer.send("register", {...})          # once the bound end has said hello
        kind, header, frames = bound.recv(time.monotonic() + 5)
    """

    LOOK_S = 0.001
    HANDSHAKE_S = 5.0  # a connection that has not shaken hands (ZeroMQ's) within this is closed
    RESEND_S = 0.25  # an unanswered hello is sent again this often
    MAX_MESSAGE_BYTES = 512 << 20  # the largest frame taken from a peer (a staged run's table of ~22M descriptors)
    MAX_CANDIDATES = 16  # (bound) connections whose hello waits for an answer, at most (the oldest forgotten)
    SLICE_MS = 50  # a blocked send looks whether its peer is gone this often

    def __init__(self, connect_port: int | None = None, peer_timeout: float = 1.0, *, host: str,
                 bind_port: int | None = None, max_message_bytes: int | None = None, secret: bytes | None = None,
                 insecure: bool = False):
        # every pairing proves the secret and every message carries a code under it; None only by the
        # explicit opt-out (.auth.channel_secret: raises off loopback when there is none, before any socket)
        self.secret = channel_secret(host, secret, insecure=insecure)
        if self.secret is None:
            auth.count_open_channel()
        zmq = require_zmq()
        from zmq.utils.monitor import recv_monitor_message

        self._zmq, self._recv_monitor = zmq, recv_monitor_message
        self._looked = 0.0  # when the monitor was last read (time.monotonic)
        self._held: pysocket.socket | None = None  # a duplicate of the peer's connection while it stands (_watch)
        self._events: deque[tuple[float, str, int]] = deque(maxlen=12)  # the last connection events: (when, what, fd)
        self.context = zmq.Context.instance()
        self._peer_timeout_ms = max(1, int(peer_timeout * 1000))
        # a frame larger than this disconnects its sender (ZeroMQ's MAXMSGSIZE): no peer makes this side
        # hold an arbitrary amount of memory in one message
        self.max_message_bytes = self.MAX_MESSAGE_BYTES if max_message_bytes is None else max_message_bytes
        self._bound = connect_port is None
        self._open_socket()
        self._open: set[int] = set()  # (bound) the connections accepted whose loss has not been read
        self._peer_rid: bytes | None = None  # (bound) the routing id of the peer's connection (kept once lost)
        self._peer_fd: int | None = None  # (bound) the peer's connection, as its messages name it (SRCFD)
        # (bound) connections that said hello and wait for an answer: routing id -> (fd, incarnation, nonce, when
        # answered); answered only while no peer's connection stands, and the first to prove is the peer
        self._candidates: OrderedDict[bytes, list[Any]] = OrderedDict()
        # (bound) connections whose hello showed they cannot pair by their secret, each told so once (bounded)
        self._mismatched: dict[bytes, None] = {}
        self._connected = False
        self._gone = False
        self._ever = False  # a peer has connected at least once
        self._replaced = False  # a peer connected after an earlier one was lost (see replaced())
        self._hello_at = 0.0  # (connecting) when this side's hello last left
        self.host = host
        self.incarnation = auth.INCARNATION  # (this process's when the channel is made: a forked child has its own)
        # messages read while this side waited (a send's handshake, a lost peer's last ones), with the
        # pairing they came in: handed out only until the next pairing begins
        self._inbox: deque[tuple[int, tuple[str, dict[str, Any], list[bytes]]]] = deque()
        self._peer_inc: str | None = None
        self._my_nonce, self._hello_sent, self._nonce_used = nonce(), False, False
        self._pairing_no = 0  # which pairing of this channel's life (messages kept are tagged with it)
        self._send_seq = 0  # (a bound end's runs on over its pairings: its answers to candidates count)
        self._seal: NoteSeal | None = None  # (note_seal) the engine notifications' seal of the pairing it was made in
        self._pairing_reset(None)
        self._reconnected = False  # the connection was made again since the last handshake ended
        self.refused = 0  # messages refused (not of the paired incarnation, out of sequence, a bad code)
        self.strangers = 0  # (bound) messages refused for coming on a connection that is not the peer's
        self.closed = False  # closed by its owner: it has no peer, reads nothing and sends nothing from then on
        # how the last peer's connection was lost: "closed" (its end closed: the process ended or closed it) or
        # "silence" (it stopped answering; its writes may still land); None while none was lost
        self.lost_by: str | None = None
        try:
            if connect_port is None and bind_port:  # a known port (an SGLang bootstrap port)
                self.socket.bind(f"tcp://{host}:{bind_port}")
                self.port = bind_port
            elif connect_port is None:
                self.port = self.socket.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError:
            self.close()  # (nothing of a channel that could not listen stays open)
            raise
        if connect_port is not None:
            self.port = connect_port
            self.socket.connect(f"tcp://{host}:{connect_port}")
            self._greet()  # (once the connection is made: the other end has this side's nonce unasked)

    def _open_socket(self) -> None:
        """This end's socket (a bound end's ROUTER, a connecting end's DEALER) and the monitor on its connections."""
        zmq = self._zmq
        self.socket = self.context.socket(zmq.ROUTER if self._bound else zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 1000)
        ms = self._peer_timeout_ms
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, min(200, ms))
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms)
        self.socket.setsockopt(zmq.HEARTBEAT_TTL, ms)
        # no bound on what waits to be read: at ZeroMQ's default (1,000 messages) a connection whose owner
        # reads late stops reading the wire, its peer's heartbeats go unanswered, and after peer_timeout
        # both ends drop it with what it held, a busy live peer taken for a dead one. (A bound per peer
        # against one that floods belongs with the control plane's other bounds: docs/failures.md §11.)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        self.socket.setsockopt(zmq.HANDSHAKE_IVL, round(self.HANDSHAKE_S * 1000))
        if self._bound:
            # a message for a connection that is gone raises (EHOSTUNREACH) instead of vanishing, and what this
            # side sends is never dropped at a bound: its owner's own messages, a few per request
            self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.socket.setsockopt(zmq.SNDHWM, 0)
        # the monitor by hand, its receiving end unbounded: libzmq's I/O thread writes every connection event
        # into it and blocks when it is full (pyzmq's get_monitor_socket leaves ZeroMQ's 1,000 messages), and
        # that one thread serves every socket of the process: a port scan of about 1,000 connections to a
        # channel whose owner reads late stalled every control channel and engine port of the process.
        # No handshake events: a bound end learns a connection from its messages (_read).
        address = f"inproc://kvplan-monitor-{next(monitor_numbers)}"
        self.socket.monitor(address, zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._monitor = self.context.socket(zmq.PAIR)
        self._monitor.setsockopt(zmq.RCVHWM, 0)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(address)

    send_timeout = 10.0

    def send(self, kind: str, header: dict[str, Any] | None = None, *frames: bytes, timeout: float | None = None) -> None:
        """Send one message; raise :class:`ControlTimeout` if the peer cannot take it in time (a
        connecting end with no connection would otherwise block forever; a bound end whose peer is lost
        waits for the next one to pair). The first message of a pairing waits for the handshake
        (:mod:`.auth`) within the same time.
        """
        kind = str(kind)  # (a control_messages.Kind is its wire string; its repr is not, in the errors below)
        wait_s = self.send_timeout if timeout is None else timeout
        if self.closed:
            raise ControlTimeout(f"the channel on {self.host} port {self.port} is closed: a {kind!r} message cannot leave")
        deadline = time.monotonic() + wait_s
        if self._key is None or not self._authed or (self._bound and self._gone):
            self._shake_hands(deadline, kind, wait_s)
        self._out(kind, header or {}, frames, deadline, wait_s)

    def _out(self, kind: str, header: dict[str, Any], frames: tuple[bytes, ...] | list[bytes], deadline: float,
             wait_s: float, to: tuple[bytes, str] | None = None) -> None:
        """One message out within the deadline: to the peer, or on a bound end to ``to`` (a candidate's
        routing id and incarnation: its handshake's steps, which carry no code)."""
        parts = [kind.encode(), json.dumps(header).encode(), *frames]
        if self._bound:
            self._out_bound(kind, parts, deadline, wait_s, to)
            return
        while True:
            # in slices: a peer that is gone (dead, or silent past its heartbeats) ends the wait at once
            if self.socket.poll(max(0, min(self.SLICE_MS, round(1000 * (deadline - time.monotonic())))),
                                self._zmq.POLLOUT):
                envelope = self._envelope(self._peer_inc or "")
                code = message_code(self._key, envelope, parts) if self.secret is not None and self._key else b""
                try:
                    self.socket.send_multipart([MARK, envelope, code, *parts], self._zmq.NOBLOCK)
                    self._send_seq += 1
                    return
                except self._zmq.Again:  # writable a moment ago: the peer's pipe went away in between
                    time.sleep(0.001)
            if self.peer_gone():
                raise ControlTimeout(f"the peer of the channel on {self.host} port {self.port} is gone: a {kind!r} "
                                     "message cannot leave")
            if time.monotonic() >= deadline:
                state = "connected" if self._connected else "was connected" if self._ever else "never connected"
                raise ControlTimeout(f"the peer did not take a {kind!r} message within {round(wait_s * 1000)} ms "
                                     f"(channel on {self.host} port {self.port}; its peer {state}; its last "
                                     f"connection events {list(self._events)})")

    def _envelope(self, receiver: str) -> bytes:
        return json.dumps({"f": self.incarnation, "t": receiver, "s": self._send_seq + 1}).encode()

    def _out_bound(self, kind: str, parts: list[bytes], deadline: float, wait_s: float,
                   to: tuple[bytes, str] | None) -> None:
        """A bound end's send: never waits (no bound on what it queues); a connection that is gone raises."""
        zmq = self._zmq
        rid, receiver = to if to is not None else (self._peer_rid, self._peer_inc or "")
        if rid is None or (to is None and self._gone):
            raise ControlTimeout(f"the channel on {self.host} port {self.port} has no peer: a {kind!r} message "
                                 "cannot leave")
        envelope = self._envelope(receiver)
        code = message_code(self._key, envelope, parts) if self.secret is not None and self._key and to is None else b""
        pause = 0.001
        while True:
            try:
                self.socket.send_multipart([rid, MARK, envelope, code, *parts], zmq.NOBLOCK)
                self._send_seq += 1
                return
            except zmq.Again as err:  # (a queue at a bound: none is set, but a wait is what it would ask)
                left = deadline - time.monotonic()
                if left <= 0 or (to is None and self.peer_gone()):
                    raise ControlTimeout(f"the peer did not take a {kind!r} message within {round(wait_s * 1000)} ms "
                                         f"(channel on {self.host} port {self.port})") from err
                time.sleep(min(pause, left))
                pause = min(2 * pause, self.SLICE_MS / 1000)
            except zmq.ZMQError as err:
                if err.errno != zmq.EHOSTUNREACH:
                    raise
                # (its connection went away: the monitor says so within a moment)
                raise ControlTimeout(f"the peer of the channel on {self.host} port {self.port} is gone: a {kind!r} "
                                     "message cannot leave") from err

    # -- the handshake (.auth) ---------------------------------------------------------------------
    def _pairing_reset(self, peer: str | None, *, next_pairing: bool = True) -> None:
        """Forget the pairing, for one with ``peer`` (or none yet). This side's nonce and hello stay while no
        pairing has used them. Messages kept from the pairing forgotten are not handed out once the next one
        begins (``next_pairing``; a lost peer's are, until then)."""
        self._pairing_no += next_pairing
        if self._nonce_used:  # (an unused one may still be on its way in a hello, and serves the new pairing)
            self._my_nonce, self._hello_sent, self._nonce_used = nonce(), False, False
        self._peer_inc, self._peer_nonce = peer, None
        self._authed, self._key = False, None
        if not self._bound:
            self._send_seq = 0
        self._recv_seq = 0
        self._proof_refused = False
        # why the last peer (or, on a bound end, candidate) could not pair by its secret (.control_handshake)
        self._mismatch: str | None = None
        self._answered = 0.0

    def pairing_id(self) -> int | None:
        """Which pairing of this channel's life holds now: ``None`` before a handshake has ended and from the
        moment the connection is lost on a bound end, or made again on either (a restarted peer, or a
        connection lost and made again: a new pairing follows). An owner keeps what a peer told it with
        this number and drops it once the number differs: nothing a peer published goes to its successor."""
        if self.closed:
            return None
        self.peer_gone()  # (reads the connection's events: a loss or a new connection ends the pairing)
        if not self._authed or (self._bound and self._gone):
            return None
        return self._pairing_no

    def note_seal(self) -> NoteSeal | None:
        """The seal of this pairing's engine notifications (:mod:`.note_seal`): ``None`` without a secret or
        before the handshake has ended. A new pairing has a new seal: notes sealed for the last one do not
        open under it."""
        if self.secret is None or not self._authed or self._key is None or self._peer_inc is None:
            return None
        seal = self._seal
        if seal is None or seal.pairing_key is not self._key:
            seal = self._seal = NoteSeal(self._key, self.incarnation, self._peer_inc)
        return seal

    @property
    def peer_incarnation(self) -> str | None:
        """The incarnation this channel is paired with (``None`` before its handshake has ended)."""
        return self._peer_inc if self._authed else None

    # -- receiving -----------------------------------------------------------------------------------
    def _keep(self, message: tuple[str, dict[str, Any], list[bytes]] | None) -> None:
        if message is not None:
            self._inbox.append((self._pairing_no, message))

    def _pop(self) -> tuple[str, dict[str, Any], list[bytes]] | None:
        """The oldest message kept of the current pairing; those of an earlier one are refused."""
        while self._inbox:
            pairing, message = self._inbox.popleft()
            if pairing == self._pairing_no:
                return message
            self._refuse(f"a {message[0]!r} message of an earlier pairing, read before it ended and not taken then")
        return None

    def pending(self) -> bool:
        """Whether a message read while this side waited is kept for :meth:`try_recv` (a wait on the
        socket alone would not see it)."""
        return bool(self._inbox) and not self.closed

    def recv(self, deadline: float) -> tuple[str, dict[str, Any], list[bytes]]:
        if self.closed:
            raise ControlTimeout(f"the channel on {self.host} port {self.port} is closed: nothing comes")
        self._greet()
        while True:
            kept = self._pop()
            if kept is not None:
                return kept
            timeout_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if self._mismatch is not None and not self._bound and not self._authed:
                raise self._mismatch_error(self._mismatch)  # (its one peer cannot pair: nothing can come)
            if not self.socket.poll(min(timeout_ms, round(self.RESEND_S * 1000)) if not self._authed else timeout_ms):
                if time.monotonic() >= deadline:
                    if self._mismatch is not None:
                        raise self._mismatch_error(self._mismatch)
                    raise ControlTimeout("no control message before the deadline")
                self._greet()
                self.peer_gone()
                continue
            message = self._take(*self._read())
            if message is not None:
                return message

    def advance(self) -> bool:
        """Take what has arrived without handing it out (never waits): the handshake's steps are answered,
        the peer's messages kept for :meth:`try_recv`; whether one is kept. A listener asks this of the
        channels it handed out: one is ready when its peer has paired and sent, not when anyone sent a byte."""
        if self.closed:
            return False
        self._greet()
        while self.socket.poll(0):
            self._keep(self._take(*self._read()))
        return bool(self._inbox)

    def wait_sockets(self) -> list[Any]:
        """The ZeroMQ sockets a loop waits on for this channel (:func:`~.runtime.loop.wait_ready`): its
        own. Its connection monitor is not among them: it is read at most every ``LOOK_S`` (a wait on it
        would end at once until then), so a loop sees a loss at its next look (within
        :data:`~.runtime.loop.IDLE_S` when idle). Only the thread that owns the channel may wait on them."""
        return [] if self.closed else [self.socket]

    def wait_readable(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds (ZeroMQ counts whole milliseconds) until a message can be read
        (or a step of the handshake, or a stranger's message: :meth:`try_recv` may then return ``None``). A
        closed channel: never."""
        if self.closed:
            return False
        return bool(self._inbox) or bool(self.socket.poll(max(0, round(timeout * 1000))))

    def try_recv(self) -> tuple[str, dict[str, Any], list[bytes]] | None:
        if self.closed:
            return None
        self._greet()
        kept = self._pop()
        if kept is not None:
            return kept
        while self.socket.poll(0):
            message = self._take(*self._read())
            if message is not None:
                return message
        return None

    def __del__(self) -> None:
        # a channel dropped unclosed: its sockets close in any order, and one that closes after its monitor's
        # reading end would leave libzmq's I/O thread waiting for ever to send it an event (every socket of
        # the process with it): the monitor is stopped first
        try:
            if not self.closed:
                self.socket.disable_monitor()
        except Exception:  # (half made, or the interpreter shutting down)
            pass

    def close(self) -> None:
        """Close the sockets (queued messages get a second to leave); calling it again does nothing."""
        if self.closed:
            return
        self.closed, self._gone, self._connected = True, True, False
        self._unwatch()
        self.socket.disable_monitor()
        self._monitor.close(0)
        self.socket.close()
