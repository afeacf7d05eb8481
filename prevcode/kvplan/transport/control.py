"""The control path between a decode and a prefill endpoint: ZeroMQ PAIR sockets on 127.0.0.1.

Messages are multipart: a kind, a JSON header, then binary frames (engine metadata, index-list
messages in SGLang's wire format, descriptor tables). Every receive has a deadline.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..errors import KvplanError

__all__ = ["ControlChannel", "ControlTimeout"]


class ControlTimeout(KvplanError, TimeoutError):
    """No control message arrived before the deadline."""


class ControlChannel:
    """One end of a PAIR socket; the decode side binds an ephemeral port, the prefill side connects."""

    def __init__(self, connect_port: int | None = None):
        import zmq

        self._zmq = zmq
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.PAIR)
        self.socket.setsockopt(zmq.LINGER, 0)
        if connect_port is None:
            self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        else:
            self.port = connect_port
            self.socket.connect(f"tcp://127.0.0.1:{connect_port}")

    send_timeout = 10.0

    def send(self, kind: str, header: dict[str, Any] | None = None, *frames: bytes, timeout: float | None = None) -> None:
        """Send one message; raise :class:`ControlTimeout` if the peer cannot take it in time.

        (A PAIR socket with no connected peer would otherwise block forever.)
        """
        wait_ms = int(1000 * (self.send_timeout if timeout is None else timeout))
        if not self.socket.poll(wait_ms, self._zmq.POLLOUT):
            raise ControlTimeout(f"the peer did not take a {kind!r} message within {wait_ms} ms")
        self.socket.send_multipart([kind.encode(), json.dumps(header or {}).encode(), *frames], self._zmq.NOBLOCK)

    def recv(self, deadline: float) -> tuple[str, dict[str, Any], list[bytes]]:
        timeout_ms = max(0, int((deadline - time.monotonic()) * 1000))
        if not self.socket.poll(timeout_ms):
            raise ControlTimeout("no control message before the deadline")
        kind, header, *frames = self.socket.recv_multipart()
        return kind.decode(), json.loads(header), frames

    def try_recv(self) -> tuple[str, dict[str, Any], list[bytes]] | None:
        if not self.socket.poll(0):
            return None
        kind, header, *frames = self.socket.recv_multipart()
        return kind.decode(), json.loads(header), frames

    def close(self) -> None:
        self.socket.close(0)
