"""kvplan's Triton kernels: pure functions on tensors, each file with its launcher and shape contract."""

from __future__ import annotations

import os

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
