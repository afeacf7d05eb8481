"""The control path between a decode and a prefill endpoint: ZeroMQ PAIR sockets on the caller's address.

Messages are multipart: a kind, a JSON header, then binary frames (engine metadata, index-list
messages in SGLang's wire format, descriptor tables). Every receive has a deadline.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ..errors import KvplanError

__all__ = ["ControlChannel", "ControlTimeout", "MAX_REFUSED", "named_request"]

log = logging.getLogger("kvplan")

MAX_REFUSED = 4096  # requests one "refuse" message names at most (a sender keeps the last 4096 refused)


class ControlTimeout(KvplanError, TimeoutError):
    """No control message arrived before the deadline."""


def _parse(parts: list[bytes]) -> tuple[str, dict[str, Any], list[bytes]]:
    """A message's kind, header and frames; what a peer sends malformed becomes kind ``"malformed"``
    (every handler ignores kinds it does not know), never an exception in the receiving loop."""
    try:
        header = json.loads(parts[1])
        if isinstance(header, dict):
            return parts[0].decode(), header, parts[2:]
    except (IndexError, UnicodeDecodeError, ValueError):
        pass
    return "malformed", {}, parts

def named_request(header: dict[str, Any]) -> str | int | None:
    """The request a peer's message names, if it names one as a request is named (a string or an
    integer); ``None`` for anything else, which no lookup may be handed (a list is not hashable)."""
    request = header.get("request")
    return request if isinstance(request, (str, int)) and not isinstance(request, bool) else None


class ControlChannel:
    """One end of a PAIR socket; the decode side binds an ephemeral port (or ``bind_port``), the
    prefill side connects (either end may bind: the SGLang adapter binds the prefill's bootstrap port).

    ZeroMQ's own heartbeats run both ways (every 0.2 s; a peer silent for ``peer_timeout`` seconds
    is dropped; they are answered by ZeroMQ's I/O thread, so a peer whose owner is busy, however many
    messages wait for it, is not silent: its receive queue has no bound), and a monitor watches the connection: :meth:`peer_gone` turns true within about
    ``peer_timeout`` of the peer dying or hanging, and at once when its process exits. A bound
    channel takes a new peer once the old one is gone (a restarted process connecting to the same
    port); :meth:`replaced` says when that happened, so that the owner can pair again. Messages
    still queued at :meth:`close` get a second to leave (a final ``failed`` must not be lost).

    The monitor is read at most every ``LOOK_S`` seconds: the transport's loops ask on every turn,
    and a turn that reads it costs several times one that does not (a streamed send's last group is
    noticed and posted from such a loop; docs/layerwise.md §3).
    """

    LOOK_S = 0.001
    HANDSHAKE_S = 5.0  # a connection that has not shaken hands (ZeroMQ's) within this is closed
    MAX_MESSAGE_BYTES = 512 << 20  # the largest frame taken from a peer (a staged run's table of ~22M descriptors)
    SLICE_MS = 50  # a blocked send looks whether its peer is gone this often

    def __init__(self, connect_port: int | None = None, peer_timeout: float = 1.0, *, host: str,
                 bind_port: int | None = None, max_message_bytes: int | None = None):
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        self._zmq, self._recv_monitor = zmq, recv_monitor_message
        self._looked = 0.0  # when the monitor was last read (time.monotonic)
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.PAIR)
        self.socket.setsockopt(zmq.LINGER, 1000)
        ms = max(1, int(peer_timeout * 1000))
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, min(200, ms))
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms)
        self.socket.setsockopt(zmq.HEARTBEAT_TTL, ms)
        # no bound on what waits to be read: at ZeroMQ's default (1,000 messages) a connection whose owner
        # reads late stops reading the wire, its peer's heartbeats go unanswered, and after peer_timeout
        # both ends drop it with what it held, a busy live peer taken for a dead one. (A bound per peer
        # against one that floods belongs with the control plane's other bounds: docs/failures.md §10.)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        # a frame larger than this disconnects its sender (ZeroMQ's MAXMSGSIZE): no peer makes this side
        # hold an arbitrary amount of memory in one message
        self.max_message_bytes = self.MAX_MESSAGE_BYTES if max_message_bytes is None else max_message_bytes
        self.socket.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        self.socket.setsockopt(zmq.HANDSHAKE_IVL, round(self.HANDSHAKE_S * 1000))
        self._monitor = self.socket.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        self._bound = connect_port is None
        self._shaking: list[int] = []  # (bound) accepted connections whose handshake has not ended, oldest first
        self._peer_fd: int | None = None  # (bound) the peer's connection
        self._connected = False
        self._gone = False
        self._ever = False  # a peer has connected at least once
        self._replaced = False  # a peer connected after an earlier one was lost (see replaced())
        self.host = host
        if connect_port is None and bind_port:  # a known port (an SGLang bootstrap port)
            self.socket.bind(f"tcp://{host}:{bind_port}")
            self.port = bind_port
        elif connect_port is None:
            self.port = self.socket.bind_to_random_port(f"tcp://{host}")
        else:
            self.port = connect_port
            self.socket.connect(f"tcp://{host}:{connect_port}")

    send_timeout = 10.0

    def send(self, kind: str, header: dict[str, Any] | None = None, *frames: bytes, timeout: float | None = None) -> None:
        """Send one message; raise :class:`ControlTimeout` if the peer cannot take it in time.

        (A PAIR socket with no connected peer would otherwise block forever.)
        """
        wait_s = self.send_timeout if timeout is None else timeout
        deadline = time.monotonic() + wait_s
        parts = [kind.encode(), json.dumps(header or {}).encode(), *frames]
        while True:
            # in slices: a peer that is gone (dead, or silent past its heartbeats) ends the wait at once
            if self.socket.poll(max(0, min(self.SLICE_MS, round(1000 * (deadline - time.monotonic())))),
                                self._zmq.POLLOUT):
                try:
                    self.socket.send_multipart(parts, self._zmq.NOBLOCK)
                    return
                except self._zmq.Again:  # writable a moment ago: the peer's pipe went away in between
                    time.sleep(0.001)
            if self.peer_gone():
                raise ControlTimeout(f"the peer of the channel on {self.host} port {self.port} is gone: a {kind!r} "
                                     "message cannot leave")
            if time.monotonic() >= deadline:
                state = "connected" if self._connected else "was connected" if self._ever else "never connected"
                raise ControlTimeout(f"the peer did not take a {kind!r} message within {round(wait_s * 1000)} ms "
                                     f"(channel on {self.host} port {self.port}; its peer {state})")

    def recv(self, deadline: float) -> tuple[str, dict[str, Any], list[bytes]]:
        timeout_ms = max(0, int((deadline - time.monotonic()) * 1000))
        if not self.socket.poll(timeout_ms):
            raise ControlTimeout("no control message before the deadline")
        return _parse(self.socket.recv_multipart())

    def wait_readable(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds (ZeroMQ counts whole milliseconds) until a message can be read."""
        return bool(self.socket.poll(max(0, round(timeout * 1000))))

    def try_recv(self) -> tuple[str, dict[str, Any], list[bytes]] | None:
        if not self.socket.poll(0):
            return None
        return _parse(self.socket.recv_multipart())

    def peer_gone(self) -> bool:
        """Whether the peer was connected and its connection has since been lost (death or silence)."""
        now = time.monotonic()
        if now - self._looked < self.LOOK_S:
            return self._gone
        self._looked = now
        while self._monitor.poll(0):
            message = self._recv_monitor(self._monitor)
            event = message["event"]
            if self._bound:
                self._bound_event(message)
            elif event == self._zmq.EVENT_CONNECTED:
                self._peer_connected()
            elif event == self._zmq.EVENT_DISCONNECTED and self._connected:
                self._peer_lost()
        return self._gone

    def _bound_event(self, message: dict[str, Any]) -> None:
        """A bound socket's connection event, taken as its peer's only when it is of its peer's connection:
        anyone who reaches the port can connect and close (a port scan, a stranger), and a PAIR socket
        keeps one peer and drops the others. Each accepted connection's handshake result is its own (the
        oldest accepted one still waiting for it: ZeroMQ names no connection in that event); the first
        that succeeds while the channel has no peer is the peer's, and only its disconnection is the
        peer's loss. (A connection accepted before the peer's that never shakes hands, held open across
        the peer's own, can take its place in that order: ZeroMQ closes it within ``HANDSHAKE_S``.)"""
        zmq, event, fd = self._zmq, message["event"], message["value"]
        if event == zmq.EVENT_ACCEPTED:
            self._shaking.append(fd)
        elif event in (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                       zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH):
            fd = self._shaking.pop(0) if self._shaking else None
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED and fd is not None and self._peer_fd is None:
                self._peer_fd = fd
                self._peer_connected()
        elif event == zmq.EVENT_DISCONNECTED:
            if fd in self._shaking:
                self._shaking.remove(fd)
            if fd == self._peer_fd:
                self._peer_fd = None
                self._peer_lost()
            else:
                log.debug("a connection to the channel on %s port %d that was not its peer's closed", self.host,
                          self.port)

    def _peer_connected(self) -> None:
        if self._ever:
            log.warning("control connection on %s port %d made again after a loss", self.host, self.port)
        self._replaced = self._replaced or self._ever
        self._ever, self._connected, self._gone = True, True, False

    def _peer_lost(self) -> None:
        log.warning("control connection on %s port %d lost", self.host, self.port)
        self._connected, self._gone = False, True

    def replaced(self) -> bool:
        """Whether a new peer has connected in place of a lost one since the last call (a restarted
        sender reconnecting to this bound channel): true once per such connection."""
        self.peer_gone()
        replaced, self._replaced = self._replaced, False
        return replaced

    def close(self) -> None:
        self.socket.disable_monitor()
        self._monitor.close(0)
        self.socket.close()
