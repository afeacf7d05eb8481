"""NIXL with its UCX backend: one-shot and prepared writes, notifications, cancellation.

Settings: ``memory`` ``"DRAM"`` (CPU tensors) or ``"VRAM"`` (CUDA), ``device_id``,
``num_threads`` (NIXL's UCX workers; lists of many descriptors are split across them, as vLLM
runs it) and ``progress_thread`` (NIXL's own progress thread, which spins with no delay; off,
the worker progresses only when kvplan looks at a write or at notifications, which its loops do
continually while a transfer is in flight). kvplan picks no network: UCX uses the devices its own
settings name (``UCX_NET_DEVICES``, ``UCX_TLS``: the caller's environment; UCX's default is every
device it finds). Tests and the demo choose loopback themselves (``UCX_NET_DEVICES=lo``).
"""

from __future__ import annotations

import logging

import numpy as np

from .base import Capabilities, Handle, TransferError
from .registry import register_engine

__all__ = ["NixlEngine", "expanded_rows", "pack_metadata", "strided_rows", "takes_strided_lists", "unpack_metadata"]

log = logging.getLogger(__name__)


#: NIXL's packages, in the order they are tried: the ``nixl`` meta-package's name, then the CUDA builds' own
NIXL_PACKAGES = ("nixl", "nixl_cu13", "nixl_cu12")


def nixl_api():
    """``(nixl_agent, nixl_agent_config)`` from whichever NIXL package is installed."""
    for package in NIXL_PACKAGES:
        try:
            api = __import__(f"{package}._api", fromlist=["nixl_agent"])
            return api.nixl_agent, api.nixl_agent_config
        except ImportError:
            continue
    raise ImportError("no NIXL package is installed (nixl-cu12, nixl-cu13 or nixl)")


def pack_metadata(device_id: int, agent_metadata: bytes) -> bytes:
    """What :meth:`NixlEngine.metadata` sends: the GPU index, then NIXL's own agent metadata."""
    return int(device_id).to_bytes(4, "little") + bytes(agent_metadata)


def unpack_metadata(metadata: bytes) -> tuple[int, bytes]:
    """``(device_id, agent_metadata)`` of :func:`pack_metadata`'s bytes."""
    return int.from_bytes(metadata[:4], "little"), metadata[4:]


def _items(items: np.ndarray) -> np.ndarray:
    """``[entries, 4]`` ``(base, item_len, slots, nbytes)`` of ``[entries, 3]`` or ``[entries, 4]`` items (a
    descriptor moves ``nbytes`` of each item, its whole ``item_len`` where the column is absent)."""
    items = np.asarray(items, dtype=np.uint64)
    items = items.reshape(-1, items.shape[-1] if items.ndim == 2 else 3)
    return items if items.shape[1] == 4 else np.concatenate([items, items[:, 1:2]], axis=1)


def expanded_rows(items: np.ndarray, device: int) -> np.ndarray:
    """``[entries, 3]`` ``(base, item_len, slots)`` (or ``[entries, 4]`` with ``nbytes``) as NIXL's ``[n, 3]``
    descriptors, one per entry x slot: descriptor ``e * slots + s`` is ``(base_e + s * item_len_e, nbytes_e,
    device)``."""
    base, item, slots, nbytes = (_items(items)[:, i] for i in range(4))
    counts = slots.astype(np.int64)
    slot = np.concatenate([np.arange(n, dtype=np.uint64) for n in counts]) if len(counts) else base
    addr = np.repeat(base, counts) + slot * np.repeat(item, counts)
    size = np.repeat(nbytes, counts)
    return np.stack([addr, size, np.full(len(addr), device, dtype=np.uint64)], axis=1)


def strided_rows(items: np.ndarray, device: int) -> np.ndarray:
    """The same list in NIXL's strided form (NIXL 1.5's ``prep_xfer_dlist``): one ``[n, 5]`` row
    ``(base, nbytes, device, stride = item_len, count = slots)`` per entry. NIXL numbers its
    descriptors as :func:`expanded_rows` does; it keeps the list compressed (on the CPU machine 160 x
    20,000 descriptors prepared in 1.8 ms against 672 ms and 245 MiB expanded, session 27), and still
    moves each descriptor as one UCX operation."""
    items = _items(items)
    return np.stack([items[:, 0], items[:, 3], np.full(len(items), device, dtype=np.uint64), items[:, 1],
                     items[:, 2]], axis=1)


def takes_strided_lists(agent_class) -> bool:
    """Whether this NIXL's ``prep_xfer_dlist`` takes the strided ``[n, 5]`` form (it says so in its
    documentation from 1.5 on; an older one would read such an array as something else)."""
    return "Nx5" in (getattr(agent_class.prep_xfer_dlist, "__doc__", None) or "")


@register_engine("nixl", probe=nixl_api, install="install it with kvplan's extra nixl (CUDA 12 build) "
                 "or nixl-cu13 (CUDA 13): pip install '.[nixl]' in kvplan's checkout (README: install)")
class NixlEngine:
    """NIXL (UCX). See the module docstring for the settings."""

    capabilities = Capabilities(prepared=True, arrays=True, notifies=True)  # not abortable: see abort()
    KEPT = 64  # reusable handles kept (staged mode keeps one per slot and wave size)

    def __init__(self, name: str, memory: str = "DRAM", device_id: int = 0, num_threads: int = 0,
                 progress_thread: bool = True):
        nixl_agent, nixl_agent_config = nixl_api()
        self.name, self.memory, self.device_id = name, memory, device_id
        try:
            config = nixl_agent_config(progress_thread, backends=["UCX"], num_threads=num_threads)
        except TypeError:  # older bindings without the thread setting
            config = nixl_agent_config(progress_thread, backends=["UCX"])
        self.agent = nixl_agent(name, config)
        self.strided_lists = takes_strided_lists(nixl_agent)  # prepared lists one row per entry (prepare)
        self._registrations = []
        self._peer_device: dict[str, int] = {}  # each connected peer's GPU index
        self._prepared: dict[tuple[str, object], tuple[object, object]] = {}
        # reusable handles by (peer, key), oldest first: (native handle, descriptors, its last Handle)
        self._kept: dict[tuple[str, object], tuple[object, np.ndarray, Handle]] = {}

    def register(self, regions: list[tuple[int, int]]) -> None:
        table = np.array([(addr, size, self.device_id) for addr, size in regions], dtype=np.uint64).reshape(-1, 3)
        self._registrations.append(self.agent.register_memory(table, self.memory))

    def metadata(self) -> bytes:
        """NIXL's agent metadata behind this side's GPU index (a peer's descriptors name its device)."""
        return pack_metadata(self.device_id, self.agent.get_agent_metadata())

    def connect(self, peer_metadata: bytes) -> str:
        device, nixl_metadata = unpack_metadata(peer_metadata)
        name = self.agent.add_remote_agent(nixl_metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self._peer_device[name] = device
        return name

    def _dlist(self, addrs: np.ndarray, sizes: np.ndarray, device: int | None = None):
        devices = np.full(len(addrs), self.device_id if device is None else device, dtype=np.uint64)
        return self.agent.get_xfer_descs(np.stack([addrs, sizes, devices], axis=1), self.memory)

    def _start(self, peer: str, nbytes: int, make, notification: bytes = b"", keep: bool = False) -> Handle:
        handle = Handle(peer, nbytes, kept=keep)
        try:
            handle.native = make()
            handle.state = (self.agent.transfer(handle.native, notification) if notification
                            else self.agent.transfer(handle.native))
        except Exception as err:  # noqa: BLE001 - nixl raises its own types (dead peer, unregistered memory)
            handle.state, handle.error = "ERR", f"NIXL write to {peer} failed: {type(err).__name__}: {err}"
        if handle.state == "ERR" and handle.error is None:
            handle.error = f"NIXL write to {peer} failed when posted"
        self._settle(handle)
        return handle

    def post(self, peer: str, descs: np.ndarray, notification: bytes, reuse: object = None) -> Handle:
        descs = np.ascontiguousarray(descs, dtype=np.uint64)
        make = lambda: self.agent.initialize_xfer(  # noqa: E731
            "WRITE", self._dlist(descs[:, 0], descs[:, 2]),
            self._dlist(descs[:, 1], descs[:, 2], self._peer_device.get(peer, self.device_id)), peer, notification)
        if reuse is None:
            return self._start(peer, int(descs[:, 2].sum()), make)
        kept = self._kept.pop((peer, reuse), None)
        if kept is not None and np.array_equal(kept[1], descs):  # repost the finished handle (NIXL allows it)
            handle = self._start(peer, int(descs[:, 2].sum()), lambda: kept[0], notification, keep=True)
        else:
            if kept is not None and kept[2].state != "PROC":
                kept[0].release()  # made for other descriptors under the same key
            handle = self._start(peer, int(descs[:, 2].sum()), make, keep=True)
        if handle.native is not None:
            self._kept[(peer, reuse)] = (handle.native, descs, handle)
            self._evict()
        return handle

    def _evict(self) -> None:
        """Release the oldest kept handles beyond ``KEPT`` that are not in flight."""
        for key in list(self._kept):
            if len(self._kept) <= self.KEPT:
                return
            native, _, last = self._kept[key]
            if last.state != "PROC":
                del self._kept[key]
                try:
                    native.release()
                except Exception as err:  # noqa: BLE001
                    log.warning("could not release a kept NIXL handle: %s", err)

    def prepare(self, peer: str, key: object, local_items: np.ndarray, remote_items: np.ndarray) -> None:
        """Prepare, once per peer, a descriptor list per side: one descriptor per entry x slot.

        ``local_items``/``remote_items`` are ``[entries, 3]`` uint64 ``(base, item_len, slots)``, or
        ``[entries, 4]`` with the bytes each descriptor moves of its item (a head slice of each page);
        descriptor ``e * slots + s`` is ``(base_e + s * item_len_e, nbytes_e)``, matching the index arrays
        of :mod:`kvplan.planner.device.prepared`.
        """
        rows = strided_rows if self.strided_lists else expanded_rows
        local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows(local_items, self.device_id), self.memory)
        remote = self.agent.prep_xfer_dlist(peer, rows(remote_items, self._peer_device.get(peer, self.device_id)),
                                            self.memory)
        self._prepared[(peer, key)] = (local, remote)

    def post_prepared(self, peer: str, key: object, src_idx: np.ndarray, dst_idx: np.ndarray,
                      notification: bytes) -> Handle:
        """A WRITE named by int32 indices into the lists :meth:`prepare` made for ``key``."""
        local, remote = self._prepared[(peer, key)]
        return self._start(peer, 0, lambda: self.agent.make_prepped_xfer(
            "WRITE", local, np.ascontiguousarray(src_idx, dtype=np.int32), remote,
            np.ascontiguousarray(dst_idx, dtype=np.int32), notification))

    def progress(self, handle: Handle) -> str:
        if handle.state == "PROC":
            try:
                handle.state = self.agent.check_xfer_state(handle.native)
            except Exception as err:  # noqa: BLE001
                handle.state, handle.error = "ERR", f"NIXL write to {handle.peer} failed: {type(err).__name__}: {err}"
            if handle.state == "ERR" and handle.error is None:
                handle.error = f"NIXL write to {handle.peer} ended in an error"
            self._settle(handle)
        return handle.state

    def _settle(self, handle: Handle) -> None:
        """Release a handle that has ended (DONE or ERR): NIXL frees it only when it is not active."""
        if handle.state == "DONE" and handle.kept:
            return
        if handle.state != "PROC" and handle.native is not None:
            if handle.kept:
                self._kept = {k: v for k, v in self._kept.items() if v[0] is not handle.native}
            try:
                handle.native.release()
            except Exception as err:  # noqa: BLE001 - an ended handle that will not release is logged
                log.warning("could not release a NIXL handle to %s: %s", handle.peer, err)
            handle.native = None

    def abort(self, handle: Handle) -> bool:
        """Whether an in-flight handle has ended. NIXL cannot stop a write that UCX is moving: releasing
        it succeeds, and its bytes still land (measured: 256 MiB over UCX's TCP transport, all after the
        release). So nothing is released here; the handle ends only when NIXL reports it DONE or ERR,
        and a caller that gives up before then (:func:`~.base.wait_all`'s ``unsafe``) must keep its
        pages out of use."""
        if handle.native is None:
            return True
        return self.progress(handle) != "PROC"

    def wait_fds(self) -> tuple[int, ...]:
        """None: NIXL's notifications and transfer states are polls (a loop polls them at its cadence)."""
        return ()

    def notifications(self) -> list[tuple[str | None, bytes]]:
        """Each with the agent that sent it (NIXL keys them by the remote agent's name)."""
        return [(agent, msg) for agent, msgs in self.agent.get_new_notifs().items() for msg in msgs]

    def notify(self, peer: str, message: bytes) -> None:
        try:
            self.agent.send_notif(peer, message)
        except Exception as err:  # noqa: BLE001 - nixl raises its own types (a dead peer)
            raise TransferError(f"NIXL could not notify {peer}: {type(err).__name__}: {err}") from err

    def stats(self) -> dict[str, int]:
        return {"regions": len(self._registrations), "peers": len(self._peer_device),
                "handles": len(self._kept) + len(self._prepared),
                "handles_max": self.KEPT + len(self._prepared)}  # (kept ones are evicted past KEPT)

    def disconnect(self, peer: str) -> None:
        """Release what was kept and prepared for ``peer`` and remove its remote agent (measured: every
        agent a prefill ever paired with stayed in NIXL's table, with its handles)."""
        for key in [k for k in self._kept if k[0] == peer]:
            native, _, last = self._kept.pop(key)
            if last.state != "PROC":
                native.release()
        for key in [k for k in self._prepared if k[0] == peer]:
            local, remote = self._prepared.pop(key)
            local.release()
            remote.release()
        self._peer_device.pop(peer, None)
        try:
            self.agent.remove_remote_agent(peer)
        except Exception as err:  # noqa: BLE001 - nixl's own types: an agent already gone
            log.warning("could not remove NIXL's remote agent %s: %s: %s", peer, type(err).__name__, err)

    def close(self) -> None:
        """Release the kept and prepared handles and the registrations, even if one release fails.
        The agent (and its progress thread) ends with this engine object: destroying it here, while
        its progress thread ran, broke the next control channel's first message in the same process
        (found in session 12)."""
        try:
            for native, _, _ in self._kept.values():
                native.release()
            for local, remote in self._prepared.values():
                local.release()
                remote.release()
            for reg in self._registrations:
                self.agent.deregister_memory(reg)
        finally:
            self._kept.clear()
            self._prepared.clear()
            self._registrations.clear()
