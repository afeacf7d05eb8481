"""Writing another process's host memory on this host (``process_vm_writev``), for the :mod:`.ipc`
engine's host path.

The kernel copies each ``(local, remote, bytes)`` descriptor straight from this process's memory into
the other's, with no shared mapping and no bounce. It needs the right to trace the other process (the
same user and, under Yama, ``kernel.yama.ptrace_scope`` 0, or ``CAP_SYS_PTRACE``): :func:`can_write`
asks once, by reading a byte. A descriptor the other process has not mapped fails the write; the
bytes of descriptors before it have landed.

Example::

    write_descriptors(peer_pid, np.array([[src_addr, dst_addr, nbytes]], np.uint64))
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from .base import TransferError

__all__ = ["can_write", "write_descriptors"]

IOV_MAX = 1024  # iovecs per call (Linux's UIO_MAXIOV)
_libc = ctypes.CDLL(None, use_errno=True)
for _call in (_libc.process_vm_writev, _libc.process_vm_readv):
    _call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    _call.restype = ctypes.c_ssize_t


def can_write(pid: int, address: int) -> str | None:
    """``None`` if this process may write process ``pid``'s memory (a one-byte read at ``address`` is
    answered), else why not."""
    byte = ctypes.create_string_buffer(1)
    local = (ctypes.c_uint64 * 2)(ctypes.addressof(byte), 1)
    remote = (ctypes.c_uint64 * 2)(address, 1)
    if _libc.process_vm_readv(pid, local, 1, remote, 1, 0) == 1:
        return None
    err = ctypes.get_errno()
    hint = " (the same user and kernel.yama.ptrace_scope 0, or CAP_SYS_PTRACE, are needed)" if err == 1 else ""
    return f"process {pid}'s memory cannot be written from here: {os.strerror(err)}{hint}"


def write_descriptors(pid: int, descs: np.ndarray) -> None:
    """Write every ``(local, remote, bytes)`` row (uint64 ``[n, 3]``) into process ``pid``; raises
    :class:`TransferError` naming the first row that could not be written."""
    descs = np.ascontiguousarray(descs, dtype=np.uint64).reshape(-1, 3)
    descs = descs[descs[:, 2] > 0]
    for lo in range(0, len(descs), IOV_MAX):
        part = descs[lo : lo + IOV_MAX]
        local = np.ascontiguousarray(part[:, [0, 2]])
        remote = np.ascontiguousarray(part[:, [1, 2]])
        want = int(part[:, 2].sum())
        done = _libc.process_vm_writev(pid, local.ctypes.data, len(part), remote.ctypes.data, len(part), 0)
        if done != want:
            err = ctypes.get_errno() if done < 0 else 0
            written = np.cumsum(part[:, 2])
            row = lo + int(np.searchsorted(written, max(done, 0), side="right"))
            why = os.strerror(err) if err else f"{max(done, 0)} of {want} bytes written"
            raise TransferError(f"writing process {pid}'s memory failed at descriptor {row} "
                                f"(remote {int(descs[row, 1]):#x}, {int(descs[row, 2])} bytes): {why}")
