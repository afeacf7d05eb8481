"""What one engine write with a notification costs, by size: the floor of a streamed last group.

A staged wave is one contiguous write from a staging slot with its notification. This times,
for each size, between two processes (GPU memory; the target on another card when one is named):

* ``post``: the host time of :meth:`Engine.post` itself (a kept handle, posted again: as a wave);
* ``done``: from the post until the sender sees the write ended;
* ``notified``: from the post until the target's loop has the notification (both processes read
  CLOCK_MONOTONIC, so their clocks agree).

Each size runs twice: posted from a quiet thread, then right after 2 ms of polling the engine's
notifications in a loop (as a staged sender does while it waits for a gather): NIXL's progress
thread and such a loop share the UCX worker.

Medians (and the slowest) of 10 writes after one warm-up, for NIXL (the engine that notifies).

``python -m benchmarks.post_cost [target GPU] [MiB ...]``
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

from kvplan.tools.target_process import target_process
from kvplan.transport.engines import make_engine

DEADLINE = 60.0
SIZES_MIB = (1, 4, 16, 42, 128, 320)


def target(size: int, gpu: int, conn) -> None:
    """Register a buffer, then report the clock of every notification until told to stop."""
    device = "cuda"
    if gpu:
        torch.cuda.set_device(gpu)
        device = f"cuda:{gpu}"
    engine = make_engine("nixl", "post-target", "VRAM", **({"device_id": gpu} if gpu else {}))
    buf = torch.zeros(size, dtype=torch.uint8, device=device)
    engine.register([(buf.data_ptr(), size)])
    conn.send((engine.metadata(), buf.data_ptr()))
    stop = time.monotonic() + DEADLINE * 10
    while time.monotonic() < stop:
        for note in engine.notifications():
            conn.send((note, time.perf_counter()))
        if conn.poll(0) and conn.recv() == "bye":
            return


def main() -> None:
    gpu = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    sizes = [int(x) for x in sys.argv[2:]] or list(SIZES_MIB)
    largest = max(sizes) << 20
    with target_process(target, largest, gpu) as (here, (metadata, remote)):
        engine = make_engine("nixl", "post-initiator", "VRAM")
        src = torch.ones(largest, dtype=torch.uint8, device="cuda")
        engine.register([(src.data_ptr(), largest)])
        peer = engine.connect(metadata)
        where = f"GPU 0 to GPU {gpu}" if gpu else "GPU 0 to GPU 0"
        print(f"NIXL, one write with a notification, {where}: medians (slowest) of 10, us")
        print("| MiB | posted after | post | done | notified | GiB/s to notified |")
        print("|---|---|---|---|---|---|")
        for mib, polled in [(m, p) for m in sizes for p in (False, True)]:
            descs = np.array([[src.data_ptr(), remote, mib << 20]], np.uint64)
            posts, dones, notes = [], [], []
            for rep in range(11):
                note = f"w{mib}-{rep}".encode()
                until = time.perf_counter() + (0.002 if polled else 0.0)
                while time.perf_counter() < until:
                    engine.notifications()
                t0 = time.perf_counter()
                handle = engine.post(peer, descs, note, reuse=("slot", 0, mib))
                t1 = time.perf_counter()
                deadline = time.monotonic() + DEADLINE
                while engine.progress(handle) == "PROC" and time.monotonic() < deadline:
                    pass
                t2 = time.perf_counter()
                if handle.state != "DONE":
                    raise RuntimeError(f"the write of {mib} MiB ended {handle.state}: {handle.error}")
                if not here.poll(DEADLINE):
                    raise TimeoutError(f"no notification of the write of {mib} MiB")
                seen, t3 = here.recv()
                if seen != note:
                    raise RuntimeError(f"expected notification {note!r}, got {seen!r}")
                if rep:
                    posts.append(t1 - t0)
                    dones.append(t2 - t0)
                    notes.append(t3 - t0)
            us = lambda xs: f"{statistics.median(xs) * 1e6:.0f} ({max(xs) * 1e6:.0f})"  # noqa: E731
            rate = (mib << 20) / statistics.median(notes) / 2**30
            print(f"| {mib} | {'polling' if polled else 'quiet'} | {us(posts)} | {us(dones)} | {us(notes)} | {rate:.1f} |", flush=True)


if __name__ == "__main__":
    main()
