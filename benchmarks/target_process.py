"""A target process for the engine benchmarks (``engine_ceiling``, ``post_cost``): spawned, asked for
its first message (its engine metadata and buffer address), told ``"bye"`` at the end, and joined
or killed by its own handle.

Example::

    with target_process(target, kind, size, gpu) as (conn, (metadata, remote)):
        ...  # write to ``remote`` through an engine connected with ``metadata``
"""

from __future__ import annotations

import multiprocessing as mp
from contextlib import contextmanager
from typing import Any, Callable, Iterator

START_S = 60.0  # how long the target may take to start and register


@contextmanager
def target_process(target: Callable[..., None], *args: Any) -> Iterator[tuple[Any, Any]]:
    """Run ``target(*args, conn)`` in a spawned process; yields ``(conn, its first message)``."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, there), daemon=True)
    proc.start()
    try:
        if not here.poll(START_S):
            raise TimeoutError("the target process did not start")
        yield here, here.recv()
    finally:
        here.send("bye")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
