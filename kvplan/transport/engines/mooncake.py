"""Mooncake's transfer engine: the caller's address, protocol and metadata service.

Settings (each the caller's; defaults for a node that hands off over TCP without a metadata server):
``local_hostname`` (the address peers reach this engine at; default: the node's host name),
``protocol`` (``tcp`` by default; ``rdma``, ``nvlink_intra``, ... where the wheel has them),
``metadata_server`` (``P2PHANDSHAKE``: peers exchange metadata directly) and ``device_name`` (the
NICs for RDMA, ``""``: Mooncake's choice).

A write is posted as asynchronous batches (of at most ``batch_limit`` descriptors each) but its
last descriptor: once every batch has ended, the last one goes with the notification, so the
receiver is told only after all of the write's bytes have landed (a write without a notification
goes whole in the batches). The wheel's array calls are
used where it has them (the CUDA 13 wheel 0.3.14); the CPU wheel 0.3.13 takes Python lists.

Mooncake's TCP transport reads its settings from the environment once, when the process's first
engine starts; :class:`MooncakeEngine` sets them there unless the environment already has them. Its
defaults were measured on an H200 host (``benchmarks/gpu_mooncake_sweep.sh``, session 17; the
``llama70b-tp8-p64`` batch of 6,832 descriptors, two processes, VRAM): with Mooncake's own (4 lanes per
peer, its default I/O threads, 64 KiB slices) direct mode moved 0.95 GiB/s and staged 1.63; with 16
lanes, 8 I/O threads and 1 MiB slices, 1.23 and 2.24.

``protocol="nvlink_intra"`` moves GPU memory between the GPUs of one host through the copy
engines (the CUDA 13 wheel 0.3.14; 361 GiB/s for one write between two H200s, as a torch peer
copy). Mooncake turns that transport on from the environment (``MC_INTRANODE_NVLINK=1``): asked for
that protocol, the engine sets it unless the environment already says otherwise. It costs about
2.6 us a descriptor, so a staged run (a few large writes) reaches it where thousands of pages
written one by one do not (benchmarks/RESULTS.md).

Mooncake cannot cancel a batch: it runs to its end or to Mooncake's own transfer timeout
(``MC_TRANSFER_TIMEOUT``, 30 s by default). kvplan asks each batch's status without blocking, and
a write it could not see end is reported ``unsafe`` (docs/failures.md §3).
"""

from __future__ import annotations

import json
import logging
import os
import socket

import numpy as np

from .base import Capabilities, Handle, TransferError
from .registry import register_engine

__all__ = ["MooncakeEngine", "TCP_DEFAULTS", "apply_tcp_settings"]

log = logging.getLogger(__name__)

# Mooncake's TCP settings (environment variables) that kvplan sets unless the environment has them
TCP_DEFAULTS = {
    # requests in flight per peer: above ~2048 with Mooncake's defaults a batch is refused (rc -1)
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": 65535,
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": 65535,
    "MC_TCP_LANES_PER_PEER": 16,  # connections per peer that a batch's descriptors spread over (max 16)
    "MC_NUM_TCP_IO_THREADS": 8,  # threads serving them
    "MC_TCP_SLICE_SIZE": 1 << 20,  # bytes per socket write and per bounce copy of device memory
}
# the transports Mooncake's engine knows by name (a wheel built without one refuses it when the engine starts)
PROTOCOLS = ("tcp", "rdma", "efa", "cxl", "nvmeof", "nvlink", "nvlink_intra", "hip", "musa", "barex", "ascend",
             "ubshmem", "flagcx")
_SETTINGS = {"lanes": "MC_TCP_LANES_PER_PEER", "io_threads": "MC_NUM_TCP_IO_THREADS", "slice_bytes": "MC_TCP_SLICE_SIZE"}


def apply_tcp_settings(**asked: int | None) -> dict[str, str]:
    """Put Mooncake's TCP settings into the environment: each one asked for (``lanes``, ``io_threads``,
    ``slice_bytes``; ``None``: not asked), then :data:`TCP_DEFAULTS` where the environment has none.
    Returns the settings now in force for an engine that starts in this process.

    Example::

        apply_tcp_settings(lanes=8)   # MC_TCP_LANES_PER_PEER=8, the rest as the environment or TCP_DEFAULTS say
    """
    for setting, value in asked.items():
        if setting not in _SETTINGS:
            raise ValueError(f"unknown Mooncake setting {setting!r}; choose from {', '.join(_SETTINGS)}")
        if value is not None:
            if int(value) < 1:
                raise ValueError(f"Mooncake's {setting} must be positive, got {value}")
            os.environ[_SETTINGS[setting]] = str(int(value))
    for var, value in TCP_DEFAULTS.items():
        os.environ.setdefault(var, str(value))
    settings = {var: os.environ[var] for var in TCP_DEFAULTS}
    log.debug("Mooncake TCP settings: %s", settings)
    return settings


def _import_mooncake() -> None:
    import mooncake.engine  # noqa: F401


@register_engine("mooncake", probe=_import_mooncake,
                 install="install it with kvplan's extra mooncake (CPU and TCP) or mooncake-cuda (CUDA 13, with "
                         "NVLink): pip install '.[mooncake]' in kvplan's checkout; the wheel needs libibverbs1 "
                         "(README: install)")
class MooncakeEngine:
    """Mooncake. ``memory`` is informational: Mooncake addresses host and device memory alike.
    ``local_hostname``, ``protocol``, ``metadata_server`` and ``device_name``: see the module docstring.

    ``lanes``, ``io_threads`` and ``slice_bytes`` set Mooncake's TCP lanes per peer, I/O threads and
    slice size (:data:`TCP_DEFAULTS` where neither they nor the environment say). They take effect for
    the process's first engine only: Mooncake reads them once.
    """

    SETTING_CHOICES = {"protocol": PROTOCOLS}

    batch_limit = 16384  # descriptors per batch, under the per-peer queue limits raised below

    def __init__(self, name: str = "", memory: str = "DRAM", device_id: int = 0, *, lanes: int | None = None,
                 io_threads: int | None = None, slice_bytes: int | None = None, local_hostname: str | None = None,
                 protocol: str = "tcp", metadata_server: str = "P2PHANDSHAKE", device_name: str = ""):
        if protocol == "tcp":  # Mooncake's TCP transport reads these from the environment
            apply_tcp_settings(lanes=lanes, io_threads=io_threads, slice_bytes=slice_bytes)
        elif protocol == "nvlink_intra":  # the caller asked for it: Mooncake reads the switch from the environment
            os.environ.setdefault("MC_INTRANODE_NVLINK", "1")
        elif any(v is not None for v in (lanes, io_threads, slice_bytes)):
            raise ValueError(f"lanes, io_threads and slice_bytes are Mooncake's TCP settings, not {protocol}'s")
        from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

        host = local_hostname or socket.gethostname()
        self._notify, self._opcode = TransferNotify, TransferOpcode
        self.engine = TransferEngine()
        if self.engine.initialize(host, metadata_server, protocol, device_name) != 0:
            raise TransferError(f"Mooncake failed to initialise on {host} ({protocol}, metadata {metadata_server})")
        self.segment = f"{host}:{self.engine.get_rpc_port()}"  # how peers address it (SGLang: its session id)
        self.name = name or self.segment
        self.memory = memory
        self._regions: list[int] = []
        self._peers: set[str] = set()  # segments connected to (stats)
        self._protocol = protocol
        # what this wheel offers, decided once here (0.3.14 has array calls, 0.3.13 only lists)
        self.capabilities = Capabilities(arrays=hasattr(self.engine, "batch_transfer_async_write_arrays"))

    def register(self, regions: list[tuple[int, int]]) -> None:
        for addr, size in regions:
            if self.engine.register_memory(int(addr), int(size)) != 0:
                raise TransferError(f"Mooncake could not register [{addr:#x}, +{size})")
            self._regions.append(int(addr))

    def metadata(self) -> bytes:
        return json.dumps({"segment": self.segment, "name": self.name}).encode()

    def connect(self, peer_metadata: bytes) -> str:
        segment = json.loads(peer_metadata)["segment"]
        self._peers.add(segment)
        return segment

    def _submit(self, peer: str, part: np.ndarray) -> int:
        if self.capabilities.arrays:
            return self.engine.batch_transfer_async_write_arrays(peer, part[:, 0].copy(), part[:, 1].copy(),
                                                                 part[:, 2].copy())
        return self.engine.batch_transfer_async_write(peer, part[:, 0].tolist(), part[:, 1].tolist(),
                                                      part[:, 2].tolist())

    def post(self, peer: str, descs: np.ndarray, notification: bytes, reuse: object = None) -> Handle:
        """Post ``descs`` to ``peer``; an empty ``notification`` notifies nothing (a peer that learns of
        the write otherwise, as an SGLang decode rank does from its prefill's status message)."""
        descs = np.ascontiguousarray(descs, dtype=np.uint64)
        handle = Handle(peer, int(descs[:, 2].sum()) if len(descs) else 0)
        if len(descs) == 0:
            handle.state, handle.error = "ERR", "Mooncake cannot notify without a descriptor"
            return handle
        batches = []
        body = descs[:-1] if notification else descs
        for lo in range(0, len(body), self.batch_limit):
            batch_id = self._submit(peer, body[lo : lo + self.batch_limit])
            if not batch_id:  # (the batches already submitted still run: the handle ends once they have)
                handle.error = f"Mooncake refused a batch to {peer} at descriptor {lo}"
                break
            batches.append(batch_id)
        handle.native = (batches, descs[-1].copy() if notification else None, notification)
        return handle

    def progress(self, handle: Handle) -> str:
        """Look at the handle's batches without blocking (``transfer_check_status``, which frees an id
        once it has ended: each is asked until then, never after); once all have ended, send the
        notifying tail (a one-descriptor synchronous write). A failure is reported only once every
        batch of the handle has ended, so that an ended handle has nothing in flight."""
        if handle.state != "PROC" or handle.native is None:
            return handle.state
        batches, tail, notification = handle.native
        running = []
        for batch_id in batches:
            status = self.engine.transfer_check_status(batch_id)
            if status == 0:
                running.append(batch_id)
            elif status != 1:
                handle.error = handle.error or (f"Mooncake write to {handle.peer} failed" if status == -1 else
                                                f"Mooncake write to {handle.peer} timed out (MC_TRANSFER_TIMEOUT)")
        if running:
            handle.native = (running, tail, notification)
            return handle.state
        handle.native = None
        if handle.error is not None:
            handle.state = "ERR"
            return handle.state
        if tail is None:  # nothing to notify: every descriptor went in the batches
            handle.state = "DONE"
            return handle.state
        rc = self.engine.batch_transfer_sync(handle.peer, [int(tail[0])], [int(tail[1])], [int(tail[2])],
                                             self._opcode.Write, self._notify(self.name, notification.decode()))
        handle.state = "DONE" if rc == 0 else "ERR"
        if rc != 0:
            handle.error = f"Mooncake write to {handle.peer} failed (rc {rc}) on its last descriptor"
        return handle.state

    def abort(self, handle: Handle) -> bool:
        """Whether the handle has ended: Mooncake cannot cancel a batch, which runs until it completes,
        fails or reaches ``MC_TRANSFER_TIMEOUT``; a caller that gives up first reports ``unsafe``.

        A write without a notification that is still in flight when it is aborted ends ``unsafe`` at
        once: its batches' status is all that would say it ended, and that status is not final (issue
        54: Mooncake 0.3.13 said completed 56 ms into a batch that took about 5 s, and 831 MB of 1 GiB
        landed after the abort was reported). A notifying write ends with its tail, which the receiver
        reads only after the bytes before it on the same lanes (docs/failures.md §3)."""
        if handle.native is None:
            return True
        _, tail, _ = handle.native
        if tail is None:  # (its batches still run: progress() goes on asking them, and it ends ERR)
            handle.error = ("unsafe: Mooncake cannot cancel a write, and its batch status after an abort does not "
                            "say that no more of its bytes will land")
            return True
        return self.progress(handle) != "PROC"

    def wait_fds(self) -> tuple[int, ...]:
        """None: Mooncake's notifications and transfer states are polls (a loop polls them at its cadence)."""
        return ()

    def notifications(self) -> list[tuple[str | None, bytes]]:
        """Each with the name its sender gave (a kvplan engine gives its ``name``)."""
        return [(n.name, n.msg.encode()) for n in self.engine.get_notifies()]

    def stats(self) -> dict[str, int]:
        """``connections_max``: over TCP, Mooncake opens up to its lanes per peer as batches need them,
        each way (a peer writing here counts too): that many sockets may appear, bounded by peers,
        not by requests."""
        lanes = int(os.environ.get("MC_TCP_LANES_PER_PEER", TCP_DEFAULTS["MC_TCP_LANES_PER_PEER"])) \
            if self._protocol == "tcp" else 0
        return {"regions": len(self._regions), "peers": len(self._peers), "handles": 0,  # (batches end with writes)
                "connections_max": 2 * lanes * (len(self._peers) + 1)}

    def disconnect(self, peer: str) -> None:
        """Forget ``peer`` (Mooncake's own segment cache refreshes a peer that comes back)."""
        self._peers.discard(peer)

    def close(self) -> None:
        for addr in self._regions:
            self.engine.unregister_memory(addr)
        self._regions.clear()
