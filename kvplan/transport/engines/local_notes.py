"""Notifications between engines of one host: a Unix datagram socket per engine, in the abstract
namespace of the host's network namespace (nothing on the file system to clean up), for the
:mod:`.ipc` engine.

A datagram is the sender's name and the message; an empty one is a probe that says the socket is
reachable and is dropped. Sending never blocks: a receiver whose queue is full makes :meth:`send`
say so (the caller tries again later), and a receiver that is gone raises :class:`TransferError`.

**Who sent it is the kernel's word, not the datagram's.** Anyone on the host who knows an abstract
address can send to it, so the box takes each datagram's sender credentials from the kernel
(``SO_PASSCRED``: the pid and uid the kernel attaches, which a process without privileges cannot forge)
and hands out only what a process it admitted sent (:meth:`NoteBox.admit`: the pid and engine name of a
peer the engine connected to), under the name that process registered. A datagram from another user is
dropped; one from a process of this user that is not (yet) admitted waits, up to ``UNCLAIMED`` of them,
for its sender's admission (a peer's first note may come before its metadata is read), and is then
handed out or dropped. Every datagram dropped is counted (``refused``).

Example::

    box = NoteBox("prefill-0")
    box.admit(peer_pid, "decode-0")           # the peer the engine connected to
    box.send(peer_address, b"hello")          # True: sent; False: its queue is full, try again
    for sender, message in box.receive(): ...
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
from collections import deque

from .. import auth
from .base import TransferError

__all__ = ["NoteBox"]

_boxes = itertools.count()
RECEIVE_BUFFER = 8 << 20  # bytes of datagrams a box holds unread (the kernel may cap it lower)
UNCLAIMED = 4096  # datagrams from processes not (yet) admitted that a box keeps, the oldest dropped first
_CREDENTIALS = struct.Struct("iII")  # struct ucred: pid, uid, gid


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
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # (each datagram's sender, by the kernel)
        self.socket.bind(self.address)
        self.socket.setblocking(False)
        self._prefix = len(name.encode()).to_bytes(2, "little") + name.encode()
        self._admitted: dict[int, set[str]] = {}  # pid -> the engine names it may send as
        self._unclaimed: deque[tuple[int, str, bytes]] = deque()  # (pid, name, message) not yet admitted
        self._released: list[tuple[str | None, bytes]] = []  # unclaimed ones whose sender was admitted since
        self.refused = 0  # datagrams dropped: another user's, a name its process did not register, or overflow

    def admit(self, pid: int, name: str) -> None:
        """Hand out what process ``pid`` sends as the engine ``name`` (the peer's registration says both),
        those of its datagrams that waited included."""
        self._admitted.setdefault(pid, set()).add(name)
        waiting, self._unclaimed = self._unclaimed, deque()
        for sender, sent_as, message in waiting:
            if sender == pid and sent_as == name:
                self._released.append((sent_as, message))
            else:
                self._unclaimed.append((sender, sent_as, message))

    def forget(self, pid: int, name: str) -> None:
        """Stop handing out what ``pid`` sends as ``name`` (its engine was disconnected)."""
        names = self._admitted.get(pid)
        if names is not None:
            names.discard(name)
            if not names:
                del self._admitted[pid]

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
        """Every datagram that has arrived from an admitted sender, as ``(sender name, message)``; probes,
        malformed ones and those of other users dropped, those of processes not admitted kept for later."""
        out, self._released = self._released, []
        uid = os.geteuid()
        while True:
            try:
                datagram, ancillary, _, _ = self.socket.recvmsg(1 << 20, socket.CMSG_SPACE(_CREDENTIALS.size))
            except BlockingIOError:
                return out
            if len(datagram) < 2:
                continue
            credentials = next((data for level, kind, data in ancillary
                                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS), None)
            size = int.from_bytes(datagram[:2], "little")
            if credentials is None or len(credentials) < _CREDENTIALS.size or len(datagram) < 2 + size:
                self.refused += 1
                continue
            pid, sender_uid, _ = _CREDENTIALS.unpack_from(credentials)
            name, message = datagram[2 : 2 + size].decode(errors="replace"), datagram[2 + size :]
            if sender_uid != uid:
                self.refused += 1  # (another user's process: never a peer of this one)
            elif pid == os.getpid() or name in self._admitted.get(pid, ()):  # (this process's engines: one space)
                out.append((name, message))
            else:
                if len(self._unclaimed) == UNCLAIMED:
                    self._unclaimed.popleft()
                    self.refused += 1
                self._unclaimed.append((pid, name, message))

    def fds(self) -> tuple[int, ...]:
        """The socket's descriptor, readable while a datagram waits (none once closed)."""
        fd = self.socket.fileno()
        return (fd,) if fd >= 0 else ()

    def close(self) -> None:
        self.socket.close()
