"""The same-host engine: the sender's GPU writes the receiver's pages itself (docs/engines.md).

**Pairing.** A receiver's metadata names its host (host name and boot id), process, memory kind, GPU
(by UUID), notification socket (:mod:`.local_notes`) and each region it registered: for device memory,
the CUDA IPC handle of the allocation that holds it (:mod:`.cuda_ipc`; ``cudaMalloc`` memory, the
kind PyTorch's caching allocator, SGLang and vLLM allocate). :meth:`IpcEngine.connect` refuses a peer
on another host, of another memory kind, on a GPU this process cannot see or reach, or whose
notifications it cannot send; it opens the peer's allocations once, at its first write, and closes
them when the peer is disconnected, once every write into them has ended.

**One launch per send.** :meth:`IpcEngine.post_device` takes the plan's device descriptors as they
are (no copy to the host, no host work per descriptor) and, on the engine's stream behind the
caller's, launches the translation of their destinations into this process's mapping of the peer's
memory, with every descriptor checked against the regions the peer registered
(:mod:`kvplan.kernels.translate`: one outside them is not written and fails its section), then one
copy kernel over all of them (:func:`kvplan.kernels.copy.copy_descriptors`). The launch may go before
the host knows the plan (:meth:`IpcEngine.launch_device`: the plan's row count read on the device, or
behind an event such as a layer group's mark), its sections attached once the host has read them
(:meth:`IpcEngine.section_handles`). A write has ended when
the launch's event has completed; its sections' notifications then go to the peer's socket. A
notification rather than a flag the kernel writes: the receiver already waits on its engine's
notifications (and the control channel's seals cover them, :mod:`..note_seal`), and polling device
memory would cost the receiver a launch or a host mapping per look. An aborted write is one whose
kernel is still running: it ends within the kernel's time, nothing is notified, and no byte lands
after its event.

**Host memory** (``memory="DRAM"``): the same protocol, with the descriptors translated on the host
(:func:`~kvplan.kernels.translate.reference_translate`) and written by ``process_vm_writev``
(:mod:`.process_memory`) on a thread of the engine's, so that a post returns at once. It serves
CPU pools (and this project's tests, which have no GPU).

Example::

    engine = make_engine("ipc", "prefill-0", "VRAM", 0)
    peer = engine.connect(decode_metadata)
    handles = engine.post_device(peer, plan_descs, [note_a, note_b], [(0, 100), (100, 180)])
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .base import Capabilities, Handle, TransferError, drain_seconds
from .cuda_ipc import close_handle, export, open_handle
from .local_notes import NoteBox
from .process_memory import can_write, write_descriptors
from ..zmq_import import require_zmq
from .registry import register_engine

__all__ = ["IpcEngine", "host_identity"]

log = logging.getLogger(__name__)


def host_identity() -> dict[str, str]:
    """What says two processes share a host: its name and the kernel's boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as source:
            boot = source.read().strip()
    except OSError:
        boot = ""
    return {"host": socket.gethostname(), "boot_id": boot}


def _device_uuids() -> list[str]:
    import torch

    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


@dataclass
class _Peer:
    """A connected receiver: where its regions are, and this process's mapping of them."""

    name: str
    pid: int
    address: bytes  # its notification socket
    regions: np.ndarray  # int64 [r, 3] (lo, hi, allocation index or -1), sorted by lo
    allocations: list[tuple[bytes, int, int]]  # (IPC handle, base, bytes) of each allocation holding regions
    device: int | None  # this process's index of its GPU (VRAM)
    mapped: dict[int, int] = field(default_factory=dict)  # allocation index -> this process's address of its base
    table: Any = None  # the translation table, int64 [r, 3] (lo, hi, mapped lo) where the copies run
    launches: list[Any] = field(default_factory=list)  # launches into its memory that may not have ended


class _Refused:
    """A launch to a peer that is not connected: its sections fail at once."""

    def __init__(self, peer: str, why: str):
        self.peer, self.why = peer, why


class _Launch:
    """One post's work: the device launch (its event, the flagged count and flags, kept alive until it
    ends) or the host copy (its future)."""

    def __init__(self, event: Any = None, bad: Any = None, flags: Any = None, keep: tuple = (),
                 future: Future | None = None, host_flags: np.ndarray | None = None, stream: Any = None):
        self.event, self.bad, self.flags, self.keep, self.future = event, bad, flags, keep, future
        self.stream = stream
        self.host_flags = host_flags
        self.peer = ""
        self._flagged: np.ndarray | None = None
        self._count: int | None = None  # (device) the flagged count, once the launch has ended

    def ended(self) -> bool:
        if self.future is not None:
            return self.future.done()
        if self._count is None and self.event.query():
            self._count = int(self.bad[0])  # (read at once: its pinned word is reused launches later)
        return self._count is not None

    def error(self) -> str | None:
        if self.future is None or self.future.cancelled():
            return None
        err = self.future.exception()
        return None if err is None else str(err)

    def flagged(self, lo: int, hi: int) -> int:
        """Descriptors of rows ``[lo, hi)`` outside the peer's regions (read once the launch has ended)."""
        if self._flagged is None:
            if self.host_flags is not None:
                self._flagged = self.host_flags
            elif self._count:  # (rare: read on the launch's own stream, which has ended, not the thread's)
                import torch

                with torch.cuda.stream(self.stream):
                    self._flagged = self.flags.cpu().numpy()
            else:
                self._flagged = np.zeros(0, np.int8)
        return int(self._flagged[lo:hi].sum()) if len(self._flagged) else 0


@register_engine("ipc", probe=require_zmq, install="its control channel needs pyzmq: install kvplan with its extra "
                 "ipc (README: install)")
class IpcEngine:
    """The same-host engine (see the module docstring). ``memory``: ``"VRAM"`` (CUDA IPC, the copy
    kernel on GPU ``device_id``) or ``"DRAM"`` (host memory, ``process_vm_writev``)."""

    READBACK = 1 << 16  # pinned words in the ring of launches' flagged counts

    def __init__(self, name: str = "", memory: str = "DRAM", device_id: int = 0):
        if memory not in ("DRAM", "VRAM"):
            raise ValueError(f"the ipc engine moves DRAM or VRAM, not {memory!r}")
        self.name = name or f"ipc-{os.getpid()}"
        self.memory, self.device_id = memory, device_id
        self.capabilities = Capabilities(arrays=True, notifies=True, device=True)
        self._notes = NoteBox(self.name)
        self._regions: list[tuple[int, int]] = []
        self._exports: list[list[Any]] = []  # per region: [lo, bytes, allocation index]
        self._allocations: list[tuple[bytes, int, int]] = []
        self._peers: dict[str, _Peer] = {}
        self._host = host_identity()
        self._stream = None
        self._uuid: str | None = None
        self._copier: ThreadPoolExecutor | None = None
        self._ring, self._ring_at = None, 0  # (VRAM) pinned words for launches' flagged counts (_readback)
        if memory == "VRAM":
            import torch

            from ..streams import transport_stream

            self._torch = torch
            self._device = torch.device("cuda", device_id)
            self._stream = transport_stream(self._device)
            self._uuid = _device_uuids()[device_id]

    # -- the receiver's side ---------------------------------------------------------------------------
    def register(self, regions: list[tuple[int, int]]) -> None:
        for addr, size in regions:
            addr, size = int(addr), int(size)
            index = -1
            if self.memory == "VRAM":
                handle, base, alloc = export(addr, self.device_id)
                known = [k for k, (h, b, _) in enumerate(self._allocations) if b == base]
                if known:
                    index = known[0]
                else:
                    index = len(self._allocations)
                    self._allocations.append((handle, base, alloc))
                if addr + size > base + alloc:
                    raise TransferError(f"the region [{addr:#x}, +{size}) runs past its allocation "
                                        f"[{base:#x}, +{alloc}): it spans allocations, which the ipc engine cannot map")
            self._regions.append((addr, size))
            self._exports.append([addr, size, index])

    def metadata(self) -> bytes:
        return json.dumps({"engine": "ipc", "name": self.name, **self._host, "pid": os.getpid(),
                           "memory": self.memory, "uuid": self._uuid, "notes": self._notes.address.hex(),
                           "regions": self._exports,
                           "allocations": [[h.hex(), b, s] for h, b, s in self._allocations]}).encode()

    # -- the sender's side -----------------------------------------------------------------------------
    def connect(self, peer_metadata: bytes) -> str:
        try:
            meta = json.loads(peer_metadata)
            if meta.get("engine") != "ipc":
                raise TransferError(f"the peer's engine is {meta.get('engine')!r}, not ipc")
            regions = np.array(sorted((int(lo), int(lo) + int(n), int(a)) for lo, n, a in meta["regions"]),
                               dtype=np.int64).reshape(-1, 3)
            allocations = [(bytes.fromhex(h), int(b), int(s)) for h, b, s in meta["allocations"]]
            address, pid, name = bytes.fromhex(meta["notes"]), int(meta["pid"]), str(meta["name"])
        except (ValueError, KeyError, TypeError) as err:
            raise TransferError(f"the peer's ipc metadata is malformed: {err}") from err
        if (meta.get("host"), meta.get("boot_id")) != (self._host["host"], self._host["boot_id"]):
            raise TransferError(f"the peer is on another host ({meta.get('host')}, boot {meta.get('boot_id')}; this is "
                                f"{self._host['host']}, boot {self._host['boot_id']}): the ipc engine moves within one host")
        if meta.get("memory") != self.memory:
            raise TransferError(f"the peer's memory is {meta.get('memory')}, this side's {self.memory}: the ipc engine "
                                "moves VRAM to VRAM or DRAM to DRAM")
        if len(regions) and np.any(regions[1:, 0] < regions[:-1, 1]):
            raise TransferError("the peer's regions overlap")
        device = None
        if self.memory == "VRAM":
            uuids = _device_uuids()
            if meta.get("uuid") not in uuids:
                raise TransferError(f"the peer's GPU {meta.get('uuid')} is not visible to this process (its "
                                    "CUDA_VISIBLE_DEVICES): the ipc engine cannot reach its memory")
            device = uuids.index(meta["uuid"])
            if device != self.device_id and not self._torch.cuda.can_device_access_peer(self.device_id, device):
                raise TransferError(f"GPU {self.device_id} has no peer access to GPU {device}")
            for lo, hi, a in regions:
                if not 0 <= a < len(allocations) or lo < allocations[a][1] or hi > allocations[a][1] + allocations[a][2]:
                    raise TransferError(f"the peer's region [{lo:#x}, {hi:#x}) is not inside the allocation it names")
        elif len(regions) and (why := can_write(pid, int(regions[0, 0]))) is not None:
            raise TransferError(why)
        self._notes.probe(address)
        self._notes.admit(pid, name)  # (its notes are taken from now: the kernel names their sender)
        key = f"{name}@{address.hex()}"
        if key in self._peers:  # (connected again: its mapping stands)
            return key
        self._peers[key] = _Peer(name, pid, address, regions, allocations, device)
        return key

    def _table(self, peer: _Peer) -> Any:
        """The peer's translation table where the copies run, its allocations opened on first use."""
        if peer.table is None:
            torch = self._torch
            for a, (handle, base, _) in enumerate(peer.allocations):
                if a not in peer.mapped:  # (a peer in this very process: its addresses are this process's)
                    peer.mapped[a] = base if peer.pid == os.getpid() else open_handle(handle, self.device_id)
            rows = [(lo, hi, lo - peer.allocations[a][1] + peer.mapped[a]) for lo, hi, a in peer.regions.tolist()]
            peer.table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3).to(self._device)
        return peer.table

    def post_device(self, peer: str, descs: Any, notifications: Sequence[bytes],
                    bounds: Sequence[tuple[int, int]], alignment: int = 1, typical_bytes: int = 4096) -> list[Handle]:
        """Write every row of ``descs`` (int64 ``[n, 3]``, the plan's: on this engine's GPU, or host
        memory for DRAM) into ``peer`` with one launch; one handle per section, rows ``bounds[k]``,
        whose ``notifications[k]`` goes once the launch has ended and its rows were all written (an
        empty one notifies nothing). ``alignment``: the largest power of two dividing every address
        and size; ``typical_bytes``: the descriptors' usual size (the copy kernel's shape)."""
        launch = self.launch_device(peer, descs, alignment=alignment, typical_bytes=typical_bytes)
        return self.section_handles(launch, notifications, bounds)

    def launch_device(self, peer: str, descs: Any, rows: Any = None, after: Any = None, alignment: int = 1,
                      typical_bytes: int = 4096) -> Any:
        """The launch of :meth:`post_device` without its sections: queued at once on the engine's stream
        behind the caller's stream (and ``after``, a CUDA event, where given), over the first ``rows[0]``
        rows of ``descs`` where ``rows`` is given (int64 ``[1]`` on the device: a plan's count, which
        the host need not know yet). Its sections' handles come later from :meth:`section_handles`;
        a launch given none writes its rows all the same, and notifies nothing.

        Example::

            descs, rows = pending.device_rows()                 # the plan, still running
            launch = engine.launch_device(peer, descs, rows=rows)
            handles = engine.section_handles(launch, notes, bounds)  # once its sections are read
        """
        p = self._peers.get(peer)
        if p is None:
            return _Refused(peer, "the ipc engine is not connected to it")
        if self.memory == "VRAM":
            launch = self._launch(p, descs, alignment, typical_bytes, rows, after)
        else:
            if rows is not None:  # (host memory: the plan is read here, on the sender's thread)
                descs = descs[: int(rows[0])]
            launch = self._host_launch(p, descs)
        p.launches = [x for x in p.launches if not x.ended()] + [launch]
        launch.peer = peer
        return launch

    def section_handles(self, launch: Any, notifications: Sequence[bytes],
                        bounds: Sequence[tuple[int, int]]) -> list[Handle]:
        """One handle per section of ``launch`` (from :meth:`launch_device`): rows ``bounds[k]``, whose
        ``notifications[k]`` goes once the launch has ended and those rows were all written."""
        if isinstance(launch, _Refused):
            return self._refused(launch.peer, notifications, launch.why)
        return [Handle(launch.peer, 0, native=(launch, lo, hi, note)) for note, (lo, hi) in zip(notifications, bounds)]

    def _launch(self, p: _Peer, descs: Any, alignment: int, typical_bytes: int, rows: Any = None,
                after: Any = None) -> _Launch:
        from ...kernels.copy import DIRECT, copy_descriptors
        from ...kernels.translate import translate_descriptors

        torch = self._torch
        if isinstance(descs, np.ndarray):  # (a post of host descriptors: staged waves, warm-up touches)
            descs = torch.from_numpy(np.ascontiguousarray(descs).view(np.int64)).to(self._device)
        table = self._table(p)
        caller = torch.cuda.current_stream(self._device)
        n = descs.shape[0]
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(caller)  # (the plan and the source bytes are the caller's stream's)
            if after is not None:
                self._stream.wait_event(after)
            out = torch.empty_like(descs)
            flags = torch.empty(n, dtype=torch.int8, device=self._device)
            bad = torch.zeros(1, dtype=torch.int32, device=self._device)
            translate_descriptors(descs, table, out, flags, bad, rows=rows)
            if rows is not None:  # (a plan's buffer, which its planner reuses: the caller's stream, where the next
                # plan into it goes, waits until the translation has read it; the copy reads only ``out``)
                read = torch.cuda.Event()
                read.record(self._stream)
                caller.wait_event(read)
            copy_descriptors(out, DIRECT, alignment=alignment, typical_bytes=typical_bytes, rows=rows)
            bad_host = self._readback()
            bad_host.copy_(bad, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        descs.record_stream(self._stream)
        keep = (descs, out, bad) if rows is None else (descs, out, bad, rows)
        return _Launch(event=event, bad=bad_host, flags=flags, keep=keep, stream=self._stream)

    def _readback(self) -> Any:
        """A pinned host word for one launch's flagged count: the next of a ring allocated once (a pinned
        allocation per launch cost more than the launch's kernels). A word is reused ``READBACK`` launches
        later; a launch still unread by then (its handles unlooked-at) would read a later launch's count,
        so the ring is far longer than the launches a send keeps in flight."""
        if self._ring is None:
            self._ring = self._torch.zeros(self.READBACK, dtype=self._torch.int32, pin_memory=True)
        self._ring_at = (self._ring_at + 1) % self.READBACK
        return self._ring[self._ring_at : self._ring_at + 1]

    def _host_launch(self, p: _Peer, descs: Any) -> _Launch:
        from ...kernels.translate import reference_translate

        rows = descs.cpu().numpy() if hasattr(descs, "cpu") else np.asarray(descs)  # (a plan made on a GPU)
        table = np.array([(lo, hi, lo) for lo, hi, _ in p.regions.tolist()], dtype=np.int64).reshape(-1, 3)
        if len(table):
            out, flags = reference_translate(rows.view(np.int64) if rows.dtype == np.uint64 else rows, table)
        else:
            out, flags = np.asarray(rows, np.int64).reshape(-1, 3), np.ones(len(rows), np.int8)
            out[:, 2] = 0
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="kvplan-ipc")
        return _Launch(future=self._copier.submit(write_descriptors, p.pid, out.view(np.uint64)), host_flags=flags)

    def warm_up(self, peer: str, sizes: Sequence[int], alignment: int) -> None:
        """Do now what a first write to ``peer`` would pay for: its allocations opened, the translation
        compiled for its table and the copy kernel for each launch shape of descriptors of ``sizes`` bytes
        (each launch copies 16 bytes of scratch onto themselves). At start-up: it waits for the device."""
        p = self._peers.get(peer)
        if self.memory != "VRAM" or p is None:
            return
        from ...kernels.copy import DIRECT, copy_descriptors, launch_shape
        from ...kernels.translate import translate_descriptors

        torch = self._torch
        table = self._table(p)
        with torch.cuda.stream(self._stream):
            scratch = torch.zeros(16, dtype=torch.uint8, device=self._device)
            descs = torch.tensor([[scratch.data_ptr(), scratch.data_ptr(), 16]], dtype=torch.int64, device=self._device)
            flags = torch.empty(1, dtype=torch.int8, device=self._device)
            translate_descriptors(descs, table, torch.empty_like(descs), flags,
                                  torch.zeros(1, dtype=torch.int32, device=self._device))
            for size in {launch_shape(size, alignment): size for size in sizes}.values():
                copy_descriptors(descs, DIRECT, alignment=alignment, typical_bytes=size)
        self._stream.synchronize()

    def _refused(self, peer: str, notifications: Sequence[bytes], why: str) -> list[Handle]:
        return [Handle(peer, 0, state="ERR", error=f"ipc write to {peer} refused: {why}") for _ in notifications]

    def post(self, peer: str, descs: np.ndarray, notification: bytes, reuse: object = None) -> Handle:
        """One write of host descriptors ``[n, 3]`` (staged waves, warm-up touches), through :meth:`post_device`."""
        descs = np.ascontiguousarray(descs, dtype=np.uint64).reshape(-1, 3)
        bits = int(np.bitwise_or.reduce(descs, axis=None)) if len(descs) else 16
        typical = int(descs[:, 2].sum()) // max(1, len(descs))
        # (the copy kernel's shape from the descriptors themselves: one 256 MiB write shaped as 4 KiB ones
        # ran in one program, at 6 GiB/s on an H200)
        return self.post_device(peer, descs, [notification], [(0, len(descs))], alignment=bits & -bits or 16,
                                typical_bytes=max(1, typical))[0]

    def progress(self, handle: Handle) -> str:
        if handle.state != "PROC":
            return handle.state
        launch, lo, hi, note = handle.native
        if not launch.ended():
            return handle.state
        if (why := launch.error()) is not None:
            handle.state, handle.error = "ERR", f"ipc write to {handle.peer} failed: {why}"
        elif (flagged := launch.flagged(lo, hi)) > 0:
            handle.state = "ERR"
            handle.error = (f"{flagged} descriptors lie outside the regions {handle.peer} registered: none of them "
                            "was written")
        elif note:
            p = self._peers.get(handle.peer)
            if p is None:
                handle.state, handle.error = "ERR", f"{handle.peer} was disconnected before its notification went"
            else:
                try:
                    if not self._notes.send(p.address, note):
                        return handle.state  # (its queue is full: the next look sends it)
                except TransferError as err:
                    handle.state, handle.error = "ERR", str(err)
                    return handle.state
                handle.state = "DONE"
        else:
            handle.state = "DONE"
        if handle.state == "DONE":
            handle.native = None
        return handle.state

    def abort(self, handle: Handle) -> bool:
        """Whether the handle has ended: a copy kernel cannot be stopped, but ends within its own time, and
        nothing lands after its event; an aborted handle's notification is not sent. A host write not yet
        started is cancelled."""
        if handle.native is None or handle.state != "PROC":
            return True
        launch = handle.native[0]
        if launch.future is not None:
            launch.future.cancel()
        if launch.ended():
            handle.state, handle.error = "ERR", handle.error or "aborted"
            return True
        return False

    def wait_fds(self) -> tuple[int, ...]:
        """The notification socket: readable when a peer's datagram arrives."""
        return self._notes.fds()

    def notifications(self) -> list[tuple[str | None, bytes]]:
        return self._notes.receive()

    def notify(self, peer: str, message: bytes) -> None:
        p = self._peers.get(peer)
        if p is None:
            raise TransferError(f"the ipc engine is not connected to {peer}")
        if not self._notes.send(p.address, message):
            raise TransferError(f"{peer}'s notification queue is full")

    def stats(self) -> dict[str, int]:
        return {"regions": len(self._regions), "peers": len(self._peers),
                "handles": sum(len(p.mapped) for p in self._peers.values()), "notes_refused": self._notes.refused}

    def disconnect(self, peer: str) -> None:
        """Forget ``peer``; its allocations are unmapped once every launch into them has ended (waited for
        up to :func:`~.base.drain_seconds`; a launch still running then keeps them mapped, logged)."""
        p = self._peers.pop(peer, None)
        if p is not None and not any(q.pid == p.pid and q.name == p.name for q in self._peers.values()):
            self._notes.forget(p.pid, p.name)
        if p is None or not p.mapped:
            return
        deadline = time.monotonic() + drain_seconds()
        while any(not x.ended() for x in p.launches) and time.monotonic() < deadline:
            time.sleep(0.001)
        if any(not x.ended() for x in p.launches):
            log.error("ipc: a write into %s had not ended %.1f s after its disconnect: its mappings stay open",
                      peer, drain_seconds())
            return
        for a, mapped in p.mapped.items():
            if p.pid != os.getpid():
                try:
                    close_handle(mapped, self.device_id)
                except TransferError as err:
                    log.warning("ipc: %s", err)
        p.mapped.clear()

    def close(self) -> None:
        for peer in list(self._peers):
            self.disconnect(peer)
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        self._notes.close()

