"""Which memory an address is in, as the transfer engines name it: ``"VRAM"`` or ``"DRAM"``.

An engine registers a side's regions with one memory kind (NIXL's descriptor lists, the ``ipc``
engine's CUDA IPC handles, a staging kernel's reads), so a caller that is handed raw pointers (SGLang's
``KVArgs``) asks here before it registers them. On a machine without CUDA everything is host memory.

Example::

    memory_kind(pool.data_ptr())        # "VRAM" for a CUDA tensor
    memory_kind(aux.data_ptr())         # "DRAM" for a CPU tensor, pinned or not
"""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["memory_kind"]

_MEMORY_TYPE = 2  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE
_DEVICE_TYPES = (2, 3, 4)  # CU_MEMORYTYPE_DEVICE, _ARRAY, _UNIFIED: what a kernel on the device may read
_lib: Any = None


def _driver() -> Any:
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL("libcuda.so.1")
        _lib.cuPointerGetAttribute.restype = ctypes.c_int
    return _lib


def memory_kind(address: int) -> str:
    """``"VRAM"`` where the CUDA driver knows ``address`` as device (or managed) memory, else ``"DRAM"``:
    pinned host memory, pageable host memory the driver has never seen (it answers that with an error),
    and every address on a machine without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return "DRAM"
    torch.cuda.current_stream()  # (a runtime call: the primary context is initialised and current)
    kind = ctypes.c_uint(0)
    rc = _driver().cuPointerGetAttribute(ctypes.byref(kind), _MEMORY_TYPE, ctypes.c_uint64(address))
    return "VRAM" if rc == 0 and kind.value in _DEVICE_TYPES else "DRAM"
