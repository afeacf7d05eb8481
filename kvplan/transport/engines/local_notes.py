"""Notifications between engines of one host: a Unix datagram socket per engine, in the abstract
namespace of the host's network namespace (nothing on the file system to clean up), for the
:mod:`.ipc` engine.

A datagram is the sender's name and the message; an empty one is a probe that says the socket is
reachable and is dropped. Sending never blocks: a receiver whose queue is full makes :meth:`send`
say so (the caller tries again later), and a receiver that is gone raises :class:`TransferError`.

Example::

    box = NoteBox("prefill-0")
    box.send(peer_address, b"hello")          # True: sent; False: its queue is full, try again
    for sender, message in box.receive(): ...
"""

from __future__ import annotations

import itertools
import os
import socket

from .. import auth
from .base import TransferError

__all__ = ["NoteBox"]

_boxes = itertools.count()
RECEIVE_BUFFER = 8 << 20  # bytes of datagrams a box holds unread (the kernel may cap it lower)


class NoteBox:
    """This engine's socket (``address``: what peers send to, in its metadata)."""

    def __init__(self, name: str):
        self.name = name
        self.address = f"\0kvplan-ipc-{auth.INCARNATION}-{os.getpid()}-{next(_boxes)}".encode()
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        except OSError:
            pass
        self.socket.bind(self.address)
        self.socket.setblocking(False)
        self._prefix = len(name.encode()).to_bytes(2, "little") + name.encode()

    def probe(self, address: bytes) -> None:
        """Raise :class:`TransferError` unless ``address`` is a box this process can reach."""
        self._send(address, b"")

    def send(self, address: bytes, message: bytes) -> bool:
        """Send ``message``; ``False`` if the receiver's queue is full (nothing sent)."""
        return self._send(address, self._prefix + message)

    def _send(self, address: bytes, datagram: bytes) -> bool:
        try:
            self.socket.sendto(datagram, address)
            return True
        except BlockingIOError:
            return False
        except OSError as err:
            raise TransferError(f"the peer's notification socket cannot be reached ({err}): it is gone, or in "
                                "another network namespace") from err

    def receive(self) -> list[tuple[str | None, bytes]]:
        """Every datagram that has arrived, as ``(sender name, message)``; probes and malformed ones dropped."""
        out = []
        while True:
            try:
                datagram = self.socket.recv(1 << 20)
            except BlockingIOError:
                return out
            if len(datagram) < 2:
                continue
            size = int.from_bytes(datagram[:2], "little")
            if len(datagram) >= 2 + size:
                out.append((datagram[2 : 2 + size].decode(errors="replace"), datagram[2 + size :]))

    def fds(self) -> tuple[int, ...]:
        """The socket's descriptor, readable while a datagram waits (none once closed)."""
        fd = self.socket.fileno()
        return (fd,) if fd >= 0 else ()

    def close(self) -> None:
        self.socket.close()
