"""The child processes of kvplan's tools (the demo's sides, ``kvplan load``'s processes) and of its
tests: :func:`child_process` starts them from a fork server that has imported torch and kvplan once.
And a target process for two-process engine runs (``benchmarks/engine_ceiling.py``,
``benchmarks/post_cost.py``, the engine smoke tests): started so, asked for its first message (its
engine metadata and buffer address), told ``"bye"`` at the end, and joined or killed by its own handle.

Example::

    with target_process(target, kind, size, gpu) as (conn, (metadata, remote)):
        ...  # write to ``remote`` through an engine connected with ``metadata``
"""

from __future__ import annotations

import multiprocessing as mp
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

from ..errors import KvplanError

__all__ = ["child_context", "child_message", "child_pipe", "child_process", "start_child", "target_process"]

# what a tool's child imports anyway: the fork server imports it once (see child_process)
PRELOAD = ["kvplan.tools.demo", "kvplan.tools.load"]


def child_context() -> Any:
    """The ``multiprocessing`` context of kvplan's tool processes (:func:`child_process`)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def child_process(target: Callable[..., None], *args: Any, env: Mapping[str, str] | None = None) -> Any:
    """A child process that will run ``target(*args)``, not started yet (a daemon, to be joined or
    killed by the caller through this handle).

    Where the platform has a fork server, the child is forked from it: that server, started on first
    use and ended by ``multiprocessing`` with this process, has imported torch and kvplan once, so a
    child is running in tens of milliseconds instead of the two seconds a fresh interpreter takes to
    import them (the tests and the demo start hundreds). It never touches a GPU, so a child
    initialises CUDA afresh, as a spawned one would. Elsewhere the child is spawned. Either way the
    child runs with this process's environment as it is at this call, or with ``env`` (a fork server's
    own is the one it started with); variables read at import (``TRITON_INTERPRET``) must not change in
    between.
    """
    environment = dict(os.environ if env is None else env)
    return child_context().Process(target=_with_environment, args=(environment, target, *args), daemon=True)


def start_child(target: Callable[..., None], *args: Any, env: Mapping[str, str] | None = None) -> Any:
    """:func:`child_process`, started."""
    proc = child_process(target, *args, env=env)
    proc.start()
    return proc


def child_pipe() -> tuple[Any, Any]:
    """A pipe to a child of :func:`start_child`: ``(this end, the child's end)``."""
    return mp.Pipe()


def _with_environment(environment: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    os.environ.clear()
    os.environ.update(environment)
    target(*args)


class SideFailed(KvplanError, RuntimeError):
    """A side of a run stopped on an error kvplan names (a setting, a peer that cannot pair): the message is
    that error's one line, which the command prints without a traceback."""


def child_message(conn: Any, who: str, timeout: float) -> Any:
    """The next message of a child process (``("error", traceback)`` raised as ``RuntimeError``,
    ``("failed", line)`` as :class:`SideFailed`); ``TimeoutError`` when none comes within ``timeout``
    seconds."""
    if not conn.poll(timeout):
        raise TimeoutError(f"the {who} process said nothing for {timeout:.0f} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(f"the {who} process failed:\n{msg[1]}")
    if msg[0] == "failed":
        raise SideFailed(f"the {who} side failed: {msg[1]}")
    return msg


@contextmanager
def target_process(target: Callable[..., None], *args: Any, start_s: float = 60.0) -> Iterator[tuple[Any, Any]]:
    """Run ``target(*args, conn)`` in a child process (:func:`start_child`); yields ``(conn, its first message)``, which
    must come within ``start_s`` seconds (else ``TimeoutError``)."""
    here, there = child_pipe()
    proc = start_child(target, *args, there)
    try:
        if not here.poll(start_s):
            raise TimeoutError("the target process did not start")
        yield here, here.recv()
    finally:
        here.send("bye")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
