"""CUDA streams of the transport's own: non-blocking, high priority.

torch's side streams are *blocking* streams. Work on them waits for whatever the legacy default
stream holds, and the legacy default stream waits for them. Measured on an H100
(`benchmarks/probes/stream_check.py`): one op on the default stream, queued behind a busy torch side
stream, waited 870 ms, the side stream's whole queue.

A transport stream must wait for neither. Streaming in layer groups (docs/layerwise.md) launches
its plan, gathers and scatters while the forward pass still has most of its kernels queued. Those
kernels may sit on the default stream or on a side stream. So these streams are created
non-blocking through the driver (``cuStreamCreateWithPriority(CU_STREAM_NON_BLOCKING)``) and
wrapped for torch. They order only after what they are told to wait for.

Example::

    stream = transport_stream(torch.device("cuda", 0))
    stream.wait_event(tables_written)       # the only dependency it has
    with torch.cuda.stream(stream):
        ...
"""

from __future__ import annotations

import ctypes
import logging

import torch

__all__ = ["caller_event", "transport_stream"]

log = logging.getLogger(__name__)

_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING
_kept: list[int] = []  # the driver streams made here live as long as the process


def transport_stream(device: torch.device, priority: int = -1) -> torch.cuda.Stream:
    """A non-blocking stream on ``device``, of high priority (``priority`` is clamped to the
    device's range; lower is higher). Falls back to a torch side stream, with a warning, when the
    driver cannot be reached."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        torch.cuda.synchronize(device)  # the device's primary context exists and is current here
        least, greatest = ctypes.c_int(), ctypes.c_int()
        if driver.cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)) != 0:
            raise OSError("cuCtxGetStreamPriorityRange failed")
        handle = ctypes.c_void_p()
        level = max(greatest.value, min(least.value, priority))
        status = driver.cuStreamCreateWithPriority(ctypes.byref(handle), _NON_BLOCKING, level)
        if status != 0:
            raise OSError(f"cuStreamCreateWithPriority returned {status}")
        _kept.append(handle.value)
        return torch.cuda.ExternalStream(handle.value, device=device)
    except (OSError, AttributeError) as err:
        log.warning("a non-blocking CUDA stream could not be made (%s); using a torch side stream, which waits "
                    "for the default stream", err)
        return torch.cuda.Stream(device, priority=priority)


def caller_event(table: object) -> torch.cuda.Event | None:
    """An event recorded on the caller's current stream where ``table`` (a token table) is on a GPU, for a
    progress thread's launches to wait for on the device (what the caller queued before it: the table's
    rows, the KV a batch moves); ``None`` elsewhere."""
    if not (isinstance(table, torch.Tensor) and table.is_cuda):
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(table.device))
    return event
