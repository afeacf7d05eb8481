"""CUDA IPC memory handles, through the CUDA driver (``libcuda``), for the :mod:`.ipc` engine.

A receiver exports each allocation that holds a region it registers (:func:`export`): the
allocation's base, size and IPC handle. A sender in another process of the host opens the handle
once (:func:`open_handle`), which maps the whole allocation into its address space (on another GPU
of the host too: peer access is enabled lazily), and closes it (:func:`close_handle`) once nothing
writes into it any more.

Supported: memory from ``cudaMalloc`` (PyTorch's caching allocator by default, SGLang's and vLLM's
pools). Memory from ``cuMemCreate`` (PyTorch's ``expandable_segments``, fabric memory) has no legacy
IPC handle and is refused with that reason; it would need ``cuMemExportToShareableHandle`` and a
file descriptor passed over a Unix socket, not built.

Example::

    handle, base, size = export(tensor.data_ptr())      # the receiver's, sent in its metadata
    mapped = open_handle(handle, device=0)              # the sender's: its address of ``base``
    close_handle(mapped)
"""

from __future__ import annotations

import ctypes
from typing import Any

from .base import TransferError

__all__ = ["close_handle", "export", "open_handle"]

_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1
_lib: Any = None


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _HANDLE_BYTES)]


def _driver() -> Any:
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL("libcuda.so.1")
        for name in ("cuMemGetAddressRange_v2", "cuIpcGetMemHandle", "cuIpcOpenMemHandle_v2", "cuIpcCloseMemHandle"):
            getattr(_lib, name).restype = ctypes.c_int
    return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(rc, ctypes.byref(text))
        raise TransferError(f"{what}: CUDA error {rc} ({text.value.decode() if text.value else 'unknown'})")


def _on(device: int) -> None:
    """Make ``device``'s primary context current on this thread (the driver's calls act on the thread's
    context; PyTorch's runtime makes it current when it selects the device)."""
    import torch

    torch.cuda.set_device(device)
    torch.cuda.current_stream(device)  # (a runtime call: the primary context is initialised and current)


def export(address: int, device: int) -> tuple[bytes, int, int]:
    """``(handle, base, size)`` of the allocation that holds ``address`` on ``device``."""
    _on(device)
    lib = _driver()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address)),
           f"no device allocation holds address {address:#x}")
    handle = _IpcHandle()
    rc = lib.cuIpcGetMemHandle(ctypes.byref(handle), base)
    if rc != 0:
        _check(rc, f"the allocation at {base.value:#x} ({size.value} bytes) has no CUDA IPC handle (the ipc engine "
                   "takes cudaMalloc memory; PyTorch's expandable_segments and cuMemCreate memory are not supported)")
    return ctypes.string_at(ctypes.addressof(handle), _HANDLE_BYTES), int(base.value), int(size.value)


def open_handle(handle: bytes, device: int) -> int:
    """This process's address of the allocation ``handle`` exports (mapped on ``device``'s context)."""
    if len(handle) != _HANDLE_BYTES:
        raise TransferError(f"a CUDA IPC handle is {_HANDLE_BYTES} bytes, not {len(handle)}")
    _on(device)
    mapped, native = ctypes.c_uint64(), _IpcHandle()
    ctypes.memmove(ctypes.addressof(native), handle, _HANDLE_BYTES)  # (bytes with NULs: not through c_char's value)
    _check(_driver().cuIpcOpenMemHandle_v2(ctypes.byref(mapped), native, _LAZY_ENABLE_PEER_ACCESS),
           "the peer's allocation could not be opened (cuIpcOpenMemHandle)")
    return int(mapped.value)


def close_handle(mapped: int, device: int) -> None:
    """Unmap what :func:`open_handle` mapped; nothing may write into it any more."""
    _on(device)
    _check(_driver().cuIpcCloseMemHandle(ctypes.c_uint64(mapped)), f"closing the mapping at {mapped:#x}")
