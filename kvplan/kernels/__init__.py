"""kvplan's Triton kernels: pure functions on tensors, each file with its launcher and shape contract."""

from __future__ import annotations

import os
import threading

from ..errors import KvplanError

__all__ = ["KernelsUnavailable", "require_runnable"]


class KernelsUnavailable(KvplanError, RuntimeError):
    """The kernels cannot run on this device as Triton was set up (no GPU and no interpreter)."""


def require_runnable(device_type: str) -> None:
    """Raise :class:`KernelsUnavailable` when kvplan's kernels cannot run on ``device_type``.

    On a CPU, Triton runs kernels only through its interpreter, which must be chosen before Triton
    is imported (``TRITON_INTERPRET=1``); otherwise the first launch fails with "0 active drivers".
    """
    if device_type != "cpu":
        return
    from triton.runtime.interpreter import InterpretedFunction

    from .elements import _elements_kernel

    if not isinstance(_elements_kernel, InterpretedFunction):
        setting = os.environ.get("TRITON_INTERPRET")
        raise KernelsUnavailable(
            "kvplan's kernels run on CPU tensors only through Triton's interpreter: set TRITON_INTERPRET=1 in "
            f"the environment before kvplan or triton is imported (it is {setting!r} here), or put the token "
            "table and slot maps on a CUDA device")


def _serialize_interpreted_launches() -> None:
    """Triton's interpreter patches ``triton.language`` for the length of each launch, so launches
    from two threads at once break each other (a prefill and a decode endpoint in one process, on the
    CPU). Under the interpreter, every launch takes one process-wide lock; compiled kernels are untouched."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime.interpreter import InterpretedFunction

    if getattr(InterpretedFunction.run, "kvplan_serialized", False):
        return
    lock, run = threading.RLock(), InterpretedFunction.run

    def serialized(self, *args, **kwargs):
        with lock:
            return run(self, *args, **kwargs)

    serialized.kvplan_serialized = True
    InterpretedFunction.run = serialized


_serialize_interpreted_launches()
