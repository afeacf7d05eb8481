"""Whether the control channel's peer stands (:class:`Liveness`, a part of :class:`~.control.ControlChannel`):
the socket monitor's connection events (on a bound end, only those of its peer's connection), a held
duplicate of the peer's connection that tells at its loss whether the peer closed it or fell silent,
and a peer replaced by a new connection."""

from __future__ import annotations

import logging
import os
import socket as pysocket
import time
from typing import Any

from .control_wire import EVENT_NAMES, TCP_ESTABLISHED

__all__ = ["Liveness"]

log = logging.getLogger(__name__)


class Liveness:
    """The liveness half of :class:`~.control.ControlChannel` (its state lives on the channel)."""

    def _bound_event(self, message: dict[str, Any]) -> None:
        """A bound socket's connection event, taken as its peer's only when it is of its peer's connection:
        anyone who reaches the port can connect and close (a port scan, a stranger)."""
        zmq, event, fd = self._zmq, message["event"], message["value"]
        if event == zmq.EVENT_ACCEPTED:
            self._open.add(fd)
        elif event == zmq.EVENT_DISCONNECTED:
            self._open.discard(fd)
            for rid in [rid for rid, candidate in self._candidates.items() if candidate[0] == fd]:
                del self._candidates[rid]
            if fd == self._peer_fd and self._connected:
                self._peer_fd = None
                self._peer_lost()
            else:
                log.debug("a connection to the channel on %s port %d that was not its peer's closed", self.host,
                          self.port)

    def peer_gone(self) -> bool:
        """Whether the peer was connected and its connection has since been lost (death or silence); true
        of a closed channel."""
        if self.closed:
            return True
        now = time.monotonic()
        if now - self._looked < self.LOOK_S:
            return self._gone
        self._looked = now
        while self._monitor.poll(0):
            message = self._recv_monitor(self._monitor)
            event = message["event"]
            self._events.append((round(now, 3), EVENT_NAMES.get(event, str(event)), message["value"]))
            if self._bound:
                self._bound_event(message)
            elif event == self._zmq.EVENT_CONNECTED:
                self._peer_connected(message["value"])
            elif event == self._zmq.EVENT_DISCONNECTED and self._connected:
                self._peer_lost()
        if self._bound:
            self._answer_candidates()  # (a loss read just now lets the waiting ones in)
        return self._gone

    def _peer_connected(self, fd: int | None = None) -> None:
        """(connecting) The connection is made: after a loss, a new pairing, whose hello leaves at once."""
        self._watch(fd)
        if self._ever:
            log.warning("control connection on %s port %d made again after a loss", self.host, self.port)
            self._reconnected = True
            # (the other end takes a new connection for a new peer: a new pairing, whose hello leaves on the next
            # call that greets)
            self._pairing_reset(self._peer_inc)
        self._replaced = self._replaced or self._ever
        self._ever, self._connected, self._gone = True, True, False
        self._hello_at = 0.0

    def _watch(self, fd: int | None) -> None:
        """Hold a duplicate of the peer's connection (``fd``, ZeroMQ's), to tell at its loss how it was lost.
        Checked to be this channel's connection (the number may have been reused since the event)."""
        self._unwatch()
        if fd is None or fd < 0:
            return
        try:
            copy = os.dup(fd)
        except OSError:
            return
        try:
            held = pysocket.socket(fileno=copy)
        except OSError:  # (the number is no socket any more: its copy is closed here, not leaked)
            os.close(copy)
            return
        try:
            ports = (held.getsockname()[1], held.getpeername()[1])
            if self.port in ports and held.type == pysocket.SOCK_STREAM:
                self._held = held
                return
        except OSError:
            pass
        held.close()

    def _unwatch(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None

    def _how_lost(self) -> str:
        """``"closed"`` where the peer's end of the connection was closed (its process ended or closed the
        channel: the kernel sent its FIN or RST), ``"silence"`` where the connection still stood when ZeroMQ
        dropped it (no heartbeat within ``peer_timeout``: a stopped, hung or cut-off peer, whose writes may
        still land), or where that cannot be told (not Linux's TCP)."""
        held, self._held = self._held, None
        if held is None:
            return "silence"
        try:
            state = held.getsockopt(pysocket.IPPROTO_TCP, pysocket.TCP_INFO, 8)[0]
        except (OSError, AttributeError):
            state = TCP_ESTABLISHED
        finally:
            held.close()
        return "silence" if state == TCP_ESTABLISHED else "closed"

    def _peer_lost(self) -> None:
        self.lost_by = self._how_lost()
        log.warning("control connection on %s port %d lost", self.host, self.port)
        self._connected, self._gone = False, True

    def replaced(self) -> bool:
        """Whether a new peer has connected in place of a lost one since the last call (a restarted
        sender reconnecting to this bound channel): true once per such connection."""
        self.peer_gone()
        replaced, self._replaced = self._replaced, False
        return replaced
