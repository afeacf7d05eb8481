"""Adapters that move descriptor arrays through the real engines: NIXL (UCX) and Mooncake.

Both take a plan's descriptors as an ``[n, 3]`` uint64 NumPy array ``(src, dst, nbytes)`` (never
Python lists of tuples on the NIXL side; Mooncake's array form where the installed engine has it)
and a notification that the receiver reads once the bytes have landed. Every wait has a deadline.
Traffic stays on 127.0.0.1: set ``UCX_NET_DEVICES=lo`` for NIXL; Mooncake is initialised with
``127.0.0.1``.

Example::

    engine = NixlEngine("prefill-0")            # or MooncakeEngine()
    engine.register([(tensor.data_ptr(), tensor.numel())])
    peer = engine.connect(peer_metadata)        # bytes from the other side's engine.metadata()
    engine.write(peer, descs, b"note", deadline=time.monotonic() + 10)
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Protocol

import numpy as np

from ..errors import KvplanError

__all__ = ["Engine", "MooncakeEngine", "NixlEngine", "TransferError", "make_engine"]

log = logging.getLogger("kvplan")


class TransferError(KvplanError):
    """An engine failed to move bytes (dead peer, unregistered memory, deadline)."""


class Engine(Protocol):
    name: str

    def register(self, regions: list[tuple[int, int]]) -> None: ...

    def metadata(self) -> bytes: ...

    def connect(self, peer_metadata: bytes) -> str: ...

    def write(self, peer: str, descs: np.ndarray, notification: bytes, deadline: float) -> None: ...

    def notifications(self) -> list[bytes]: ...

    def close(self) -> None: ...


def _nixl_api():
    for module in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            api = __import__(module, fromlist=["nixl_agent"])
            return api.nixl_agent, api.nixl_agent_config
        except ImportError:
            continue
    raise ImportError("no NIXL package is installed (nixl-cu12, nixl-cu13 or nixl)")


class NixlEngine:
    """NIXL with the UCX backend; ``memory`` is ``"DRAM"`` (CPU tensors) or ``"VRAM"`` (CUDA)."""

    def __init__(self, name: str, memory: str = "DRAM", device_id: int = 0):
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        nixl_agent, nixl_agent_config = _nixl_api()
        self.name, self.memory, self.device_id = name, memory, device_id
        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self._registrations = []
        self._prepared: dict[tuple[str, object], tuple[object, object]] = {}

    def register(self, regions: list[tuple[int, int]]) -> None:
        table = np.array([(addr, size, self.device_id) for addr, size in regions], dtype=np.uint64).reshape(-1, 3)
        self._registrations.append(self.agent.register_memory(table, self.memory))

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def connect(self, peer_metadata: bytes) -> str:
        name = self.agent.add_remote_agent(peer_metadata)
        return name.decode() if isinstance(name, bytes) else name

    def _dlist(self, addrs: np.ndarray, sizes: np.ndarray):
        devices = np.full(len(addrs), self.device_id, dtype=np.uint64)
        return self.agent.get_xfer_descs(np.stack([addrs, sizes, devices], axis=1), self.memory)

    def write(self, peer: str, descs: np.ndarray, notification: bytes, deadline: float) -> None:
        descs = np.ascontiguousarray(descs, dtype=np.uint64)
        try:
            handle = self.agent.initialize_xfer("WRITE", self._dlist(descs[:, 0], descs[:, 2]),
                                                self._dlist(descs[:, 1], descs[:, 2]), peer, notification)
        except Exception as err:  # nixl raises its own exception types (dead peer, unregistered memory)
            raise TransferError(f"NIXL write to {peer} failed: {type(err).__name__}: {err}") from err
        self._finish(peer, handle, deadline)

    def _finish(self, peer: str, handle, deadline: float) -> None:
        """Post ``handle`` and poll it until done, an error or the deadline; release it."""
        try:
            state = self.agent.transfer(handle)
            while state == "PROC" and time.monotonic() < deadline:
                state = self.agent.check_xfer_state(handle)
        except Exception as err:  # noqa: BLE001 - nixl's own exception types
            raise TransferError(f"NIXL write to {peer} failed: {type(err).__name__}: {err}") from err
        if state != "DONE":
            try:
                handle.release()
            except Exception:  # noqa: BLE001 - releasing a failed handle may fail as well
                pass
            raise TransferError(f"NIXL write to {peer} ended in state {state}"
                                + (" (deadline passed)" if state == "PROC" else ""))
        handle.release()

    def prepare(self, peer: str, key: object, local_items: np.ndarray, remote_items: np.ndarray) -> None:
        """Prepare, once per peer, a descriptor list per side: one descriptor per entry x slot.

        ``local_items``/``remote_items`` are ``[entries, 3]`` uint64 ``(base, item_len, slots)``;
        descriptor ``e * slots + s`` is ``(base_e + s * item_len_e, item_len_e)``, matching the
        index arrays of :mod:`kvplan.planner.prepared`.
        """
        def rows(items: np.ndarray) -> np.ndarray:
            base, item, slots = (items[:, i].astype(np.uint64) for i in range(3))
            counts = slots.astype(np.int64)
            slot = np.concatenate([np.arange(n, dtype=np.uint64) for n in counts]) if len(counts) else base
            addr = np.repeat(base, counts) + slot * np.repeat(item, counts)
            size = np.repeat(item, counts)
            return np.stack([addr, size, np.full(len(addr), self.device_id, dtype=np.uint64)], axis=1)

        local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows(local_items), self.memory)
        remote = self.agent.prep_xfer_dlist(peer, rows(remote_items), self.memory)
        self._prepared[(peer, key)] = (local, remote)

    def write_prepared(self, peer: str, key: object, src_idx: np.ndarray, dst_idx: np.ndarray, notification: bytes,
                       deadline: float) -> None:
        """A WRITE named by int32 indices into the lists :meth:`prepare` made for ``key``."""
        local, remote = self._prepared[(peer, key)]
        try:
            handle = self.agent.make_prepped_xfer("WRITE", local, np.ascontiguousarray(src_idx, dtype=np.int32), remote,
                                                  np.ascontiguousarray(dst_idx, dtype=np.int32), notification)
        except Exception as err:  # noqa: BLE001 - nixl's own exception types
            raise TransferError(f"NIXL prepared write to {peer} failed: {type(err).__name__}: {err}") from err
        self._finish(peer, handle, deadline)

    def notifications(self) -> list[bytes]:
        return [msg for msgs in self.agent.get_new_notifs().values() for msg in msgs]

    def close(self) -> None:
        for local, remote in self._prepared.values():
            local.release()
            remote.release()
        self._prepared.clear()
        for reg in self._registrations:
            self.agent.deregister_memory(reg)
        self._registrations.clear()


class MooncakeEngine:
    """Mooncake's transfer engine over TCP with the peer-to-peer handshake, on 127.0.0.1."""

    batch_limit = 16384  # requests per call, under the per-peer queue limits raised below

    def __init__(self, name: str = "", memory: str = "DRAM"):
        os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "65535")
        os.environ.setdefault("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", "65535")
        from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

        self._notify, self._opcode = TransferNotify, TransferOpcode
        self.engine = TransferEngine()
        if self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise TransferError("Mooncake failed to initialise on 127.0.0.1")
        self.name = name or f"127.0.0.1:{self.engine.get_rpc_port()}"
        self.memory = memory
        self._regions: list[int] = []
        self._arrays = hasattr(self.engine, "batch_transfer_sync_write_arrays")

    def register(self, regions: list[tuple[int, int]]) -> None:
        for addr, size in regions:
            if self.engine.register_memory(int(addr), int(size)) != 0:
                raise TransferError(f"Mooncake could not register [{addr:#x}, +{size})")
            self._regions.append(int(addr))

    def metadata(self) -> bytes:
        return json.dumps({"segment": f"127.0.0.1:{self.engine.get_rpc_port()}", "name": self.name}).encode()

    def connect(self, peer_metadata: bytes) -> str:
        return json.loads(peer_metadata)["segment"]

    def write(self, peer: str, descs: np.ndarray, notification: bytes, deadline: float) -> None:
        descs = np.ascontiguousarray(descs, dtype=np.uint64)
        n = len(descs)
        for lo in range(0, n, self.batch_limit):
            if time.monotonic() > deadline:
                raise TransferError(f"Mooncake write to {peer}: deadline passed after {lo} of {n} descriptors")
            part = descs[lo : lo + self.batch_limit]
            last = lo + self.batch_limit >= n
            if last:
                rc = self.engine.batch_transfer_sync(peer, part[:, 0].tolist(), part[:, 1].tolist(), part[:, 2].tolist(),
                                                     self._opcode.Write, self._notify(self.name, notification.decode()))
            elif self._arrays:
                rc = self.engine.batch_transfer_sync_write_arrays(peer, part[:, 0].copy(), part[:, 1].copy(),
                                                                  part[:, 2].copy())
            else:
                rc = self.engine.batch_transfer_sync_write(peer, part[:, 0].tolist(), part[:, 1].tolist(),
                                                           part[:, 2].tolist())
            if rc != 0:
                raise TransferError(f"Mooncake write to {peer} failed (rc {rc}) at descriptors [{lo}, {lo + len(part)})")
        if n == 0:
            raise TransferError("Mooncake cannot notify without a descriptor")

    def notifications(self) -> list[bytes]:
        return [n.msg.encode() for n in self.engine.get_notifies()]

    def close(self) -> None:
        for addr in self._regions:
            self.engine.unregister_memory(addr)
        self._regions.clear()


def make_engine(kind: str, name: str, memory: str = "DRAM", device_id: int = 0) -> Engine:
    """``kind`` is ``"nixl"`` or ``"mooncake"``."""
    if kind == "nixl":
        return NixlEngine(name, memory, device_id)
    if kind == "mooncake":
        return MooncakeEngine(name, memory)
    raise ValueError(f"unknown engine {kind!r}; use 'nixl' or 'mooncake'")
