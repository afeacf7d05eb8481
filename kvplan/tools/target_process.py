"""A target process for two-process engine runs (``benchmarks/engine_ceiling.py``,
``benchmarks/post_cost.py``, the engine smoke tests): spawned, asked for its first message (its
engine metadata and buffer address), told ``"bye"`` at the end, and joined or killed by its own handle.

Example::

    with target_process(target, kind, size, gpu) as (conn, (metadata, remote)):
        ...  # write to ``remote`` through an engine connected with ``metadata``
"""

from __future__ import annotations

import multiprocessing as mp
from contextlib import contextmanager
from typing import Any, Callable, Iterator

__all__ = ["child_message", "target_process"]


def child_message(conn: Any, who: str, timeout: float) -> Any:
    """The next message of a child process (``("error", traceback)`` raised as ``RuntimeError``);
    ``TimeoutError`` when none comes within ``timeout`` seconds."""
    if not conn.poll(timeout):
        raise TimeoutError(f"the {who} process said nothing for {timeout:.0f} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(f"the {who} process failed:\n{msg[1]}")
    return msg


@contextmanager
def target_process(target: Callable[..., None], *args: Any, start_s: float = 60.0) -> Iterator[tuple[Any, Any]]:
    """Run ``target(*args, conn)`` in a spawned process; yields ``(conn, its first message)``, which
    must come within ``start_s`` seconds (else ``TimeoutError``)."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, there), daemon=True)
    proc.start()
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
