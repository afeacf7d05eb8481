"""One large write between two processes' host buffers through a kvplan engine, for the tests of
what a deadline does to a write in flight (test_nixl_deadline_fence.py, test_mooncake_hung_peer.py)."""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np


def engine(kind: str, name: str):
    """A kvplan engine on host memory; Mooncake on 127.0.0.1 (the tests' own choice)."""
    from kvplan.transport.engines import make_engine

    settings = {"local_hostname": "127.0.0.1"} if kind == "mooncake" else {}
    return make_engine(kind, name, "DRAM", 0, **settings)


def sender(kind: str, name: str, metadata: bytes, size: int, fill: int):
    """An engine holding ``size`` bytes of ``fill``, connected to the peer that sent ``metadata``:
    ``(engine, its buffer, the peer's name)``."""
    mine = engine(kind, name)
    src = np.full(size, fill, np.uint8)
    mine.register([(src.ctypes.data, size)])
    return mine, src, mine.connect(metadata)


def descriptors(src: np.ndarray, remote: int, chunk: int = 1 << 20) -> np.ndarray:
    """``src`` onto the peer's buffer at ``remote`` in ``chunk``-byte descriptors, rows of (source
    address, destination address, bytes) as kvplan's engines take them."""
    offsets = np.arange(0, src.nbytes, chunk, dtype=np.uint64)
    return np.stack([offsets + np.uint64(src.ctypes.data), offsets + np.uint64(remote),
                     np.full(len(offsets), chunk, np.uint64)], axis=1)


def serve(conn, engine, snapshot: Callable[[], Any], notes_wanted: int = 1, idle_s: float = 60.0) -> None:
    """A receiving process's loop: answer "notes" with the engine notifications that have come (waiting up to
    10 s for ``notes_wanted`` of them), "bytes" with ``snapshot()`` and ``("connect", metadata)`` with its
    engine's connection to the sender (the ipc engine takes the notes of a process it connected to), until
    "bye" or ``idle_s`` of silence; then close the engine."""
    while conn.poll(idle_s):
        asked = conn.recv()
        if asked == "bye":
            break
        if isinstance(asked, tuple) and asked[0] == "connect":  # (the sender's metadata: its notes are taken)
            conn.send(engine.connect(asked[1]))
        elif asked == "notes":
            ends, notes = time.monotonic() + 10, []
            while len(notes) < notes_wanted and time.monotonic() < ends:
                notes += engine.notifications()
                time.sleep(0.01)
            conn.send(notes)
        elif asked == "bytes":
            conn.send(snapshot())
    engine.close()
