"""In-memory stand-ins for an engine and a control channel, for protocol tests without processes."""

from __future__ import annotations

import json
from collections import deque

import numpy as np

from kvplan.transport.engines.base import Capabilities, Handle


class FakeEngine:
    """Handles finish after ``steps`` progress calls; ``stuck`` handles never do until aborted
    ``abort_after`` times (None: never)."""

    capabilities = Capabilities(abortable=True)

    def __init__(self, steps: int = 1, stuck: bool = False, abort_after: int | None = 0):
        self.name, self.steps, self.stuck, self.abort_after = "fake", steps, stuck, abort_after
        self.posted: list[tuple[np.ndarray, bytes]] = []
        self.inbox: deque[bytes] = deque()
        self.aborts = 0
        self.regions: list[tuple[int, int]] = []
        self.on_post = None  # called with (descs, notification) after each post

    def register(self, regions):
        self.regions += regions

    def metadata(self) -> bytes:
        return b"fake"

    def connect(self, peer_metadata: bytes) -> str:
        return "peer"

    def post(self, peer, descs, notification, reuse=None) -> Handle:
        self.posted.append((np.array(descs), notification))
        if self.on_post is not None:
            self.on_post(descs, notification)
        return Handle(peer, int(np.asarray(descs)[:, 2].sum()), native=[0])

    def progress(self, handle: Handle) -> str:
        if handle.state == "PROC" and not self.stuck:
            handle.native[0] += 1
            if handle.native[0] >= self.steps:
                handle.state = "DONE"
        return handle.state

    def abort(self, handle: Handle) -> bool:
        self.aborts += 1
        if self.abort_after is not None and self.aborts > self.abort_after:
            handle.state = "ERR"
            return True
        return False

    def notifications(self) -> list[tuple[str | None, bytes]]:
        """The inbox: bytes (their sender unknown) or ``(sender's engine name, bytes)``."""
        out = []
        while self.inbox:  # (popped one by one: a test may append from another thread meanwhile)
            raw = self.inbox.popleft()
            out.append((None, raw) if isinstance(raw, (bytes, bytearray)) else raw)
        return out

    def stats(self) -> dict[str, int]:
        return {"regions": len(self.regions), "peers": 0, "handles": 0}

    def disconnect(self, peer: str) -> None:
        self.disconnected = getattr(self, "disconnected", []) + [peer]

    def close(self) -> None:
        pass


class FakeDeviceEngine(FakeEngine):
    """A :class:`FakeEngine` that takes device descriptors in one launch per post
    (``Capabilities.device``): each launch is recorded as ``(rows, after)``, and each of its sections is
    recorded in :attr:`posted` as a post would be, once the launch is given its sections."""

    capabilities = Capabilities(abortable=True, device=True)

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.launches: list[tuple[np.ndarray, object]] = []

    def launch_device(self, peer, descs, rows=None, after=None, alignment=1, typical_bytes=4096):
        count = len(descs) if rows is None else int(rows[0])
        self.launches.append((np.asarray(descs[:count]).view(np.uint64), after))
        return (peer, len(self.launches) - 1)

    def section_handles(self, launch, notifications, bounds):
        peer, k = launch
        return [self.post(peer, self.launches[k][0][lo:hi], note) for note, (lo, hi) in zip(notifications, bounds)]

    def post_device(self, peer, descs, notifications, bounds, alignment=1, typical_bytes=4096):
        return self.section_handles(self.launch_device(peer, descs), notifications, bounds)


class NotifyingFakeEngine(FakeEngine):
    """A fake engine that also sends standalone notifications (``notified``: ``(peer, message)``)."""

    capabilities = Capabilities(abortable=True, notifies=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.notified: list[tuple[str, bytes]] = []
        self.connected: list[bytes] = []

    def connect(self, peer_metadata: bytes) -> str:
        self.connected.append(peer_metadata)
        return "peer"

    def notify(self, peer: str, message: bytes) -> None:
        self.notified.append((peer, message))


class FakeChannel:
    """One end of an in-memory pair; ``FakeChannel.pair()`` makes both."""

    def __init__(self):
        self.inbox: deque = deque()
        self.other: FakeChannel | None = None
        self.port = 0

    @classmethod
    def pair(cls):
        a, b = cls(), cls()
        a.other, b.other = b, a
        return a, b

    def send(self, kind, header=None, *frames, timeout=None):
        self.other.inbox.append((kind, json.loads(json.dumps(header or {})), list(frames)))

    def try_recv(self):
        return self.inbox.popleft() if self.inbox else None

    def recv(self, deadline):
        from kvplan.transport.control import ControlTimeout

        if not self.inbox:
            raise ControlTimeout("nothing queued")
        return self.inbox.popleft()

    def wait_readable(self, timeout):
        return bool(self.inbox)

    def replaced(self) -> bool:
        return False  # an in-memory pair never reconnects

    def peer_gone(self) -> bool:
        return False

    def close(self):
        pass
