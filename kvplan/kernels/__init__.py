"""kvplan's Triton kernels: pure functions on tensors, each file with its launcher and shape contract."""

from __future__ import annotations

import inspect
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


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter re-patches ``triton.language`` (walking its members) on every call of a
    ``@triton.jit`` helper from inside a kernel, although the launch around it has already patched
    the same modules; in kernels that call small helpers per field, that walk is most of the
    interpreted time. Under the interpreter, a helper's call skips the patch when the launch around
    it already holds it for every language module the helper sees; launches still patch and restore
    as before. Compiled kernels are untouched."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    if getattr(interpreter._patch_lang, "kvplan_once", False):
        return
    patch_lang = interpreter._patch_lang
    launch: list[set] = []  # the language modules the launch in progress has patched (launches never nest)
    seen: dict[object, frozenset] = {}  # each function's language modules, by function

    def patch_once(fn):
        if fn not in seen:
            seen[fn] = frozenset(id(value) for value in fn.__globals__.values()
                                 if inspect.ismodule(value) and value in (interpreter.tl, interpreter.tl.core))
        if launch:  # a helper called inside the launch, which ignores the scope (Triton never restores it)
            if seen[fn] <= launch[0]:
                return None
            launch[0] |= seen[fn]
            return patch_lang(fn)
        scope = patch_lang(fn)  # a launch: it restores the scope when it ends
        restore = scope.restore
        launch.append(set(seen[fn]))

        def restore_and_forget():
            launch.clear()
            restore()

        scope.restore = restore_and_forget
        return scope

    patch_once.kvplan_once = True
    interpreter._patch_lang = patch_once


_serialize_interpreted_launches()
_patch_language_once_per_launch()
