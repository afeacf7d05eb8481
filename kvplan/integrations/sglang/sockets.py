"""The ZeroMQ PUSH sockets of SGLang's control path: one per peer socket, each send bounded by a deadline.

Both sides of SGLang's protocol push to the other's PULL socket: a decode rank to its prefill rank
(:mod:`.decode_link`), a prefill rank back to each decode rank (:mod:`.rank_link`).

Example::

    sock = push_socket("127.0.0.1", 17000)
    push(sock, frames, timeout=1.0, peer="the prefill rank at 127.0.0.1:17000")
"""

from __future__ import annotations

from typing import Any

from ...errors import PeerError

__all__ = ["push", "push_socket"]


def push_socket(host: str, port: int) -> Any:
    """A PUSH socket connected to ``tcp://host:port`` that keeps unsent messages up to 1 s at close."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(f"tcp://{host}:{port}")
    return sock


def push(sock: Any, frames: list[bytes], timeout: float, peer: str) -> None:
    """Send ``frames`` once the socket takes them, within ``timeout`` seconds; else :class:`PeerError`
    naming ``peer``."""
    import zmq

    if not sock.poll(max(0, round(timeout * 1000)), zmq.POLLOUT):
        raise PeerError(f"{peer} did not take a message within {timeout} s")
    sock.send_multipart(frames, zmq.NOBLOCK)
