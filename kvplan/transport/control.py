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
    SLICE_MS = 50  # a blocked send looks whether its peer is gone this often

    def __init__(self, connect_port: int | None = None, peer_timeout: float = 1.0, *, host: str,
                 bind_port: int | None = None):
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
        self._monitor = self.socket.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
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
            event = self._recv_monitor(self._monitor)["event"]
            if event in (self._zmq.EVENT_ACCEPTED, self._zmq.EVENT_CONNECTED):
                if self._ever:
                    log.warning("control connection on %s port %d made again after a loss", self.host, self.port)
                self._replaced = self._replaced or self._ever
                self._ever, self._connected, self._gone = True, True, False
            elif event == self._zmq.EVENT_DISCONNECTED and self._connected:
                log.warning("control connection on %s port %d lost", self.host, self.port)
                self._gone = True
        return self._gone

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
