"""What one engine write with a notification costs, by size: the floor of a streamed last group.

A staged wave is one contiguous write from a staging slot with its notification. This times,
for each size, between two processes (GPU memory; the target on another card when one is named):

* ``post``: the host time of :meth:`Engine.post` itself (a kept handle, posted again: as a wave);
* ``done``: from the post until the sender sees the write ended;
* ``notified``: from the post until the target's loop has the notification (both processes read
  CLOCK_MONOTONIC, so their clocks agree).

Each size is posted after each of these (``MODES``):

* ``quiet``: nothing, right after the previous write (back to back);
* ``polling``: 2 ms of polling the engine's notifications in a loop (as a staged sender did while it
  waited for a gather): NIXL's progress thread and such a loop share the UCX worker;
* ``computing``: back to back, while another thread of the process keeps the sender's GPU busy with
  matmuls and waits for them (as a forward pass beside a streamed send does);
* ``yielding``: 2 ms of the loop a streamed sender runs while it waits for a layer group's mark
  (a pinned word read, the clock, a ZeroMQ poll and ``sched_yield``);
* ``yield+notes``: the same loop, asking the engine for notifications every 100 us (keeping its
  code warm without holding its worker);
* ``yield+state``: the same loop, asking the engine for the state of the last write each time;
* ``spinning``: 2 ms of a pure Python loop on the clock;
* ``sleeping``: a 2 ms sleep;
* ``beside a sync``: the yielding loop, while another thread of the process has queued ~100 ms of
  matmuls and waits in ``stream.synchronize()`` (as the stand-in forward pass does: CUDA spins there);
* ``beside a query``: the same, the other thread waiting by ``event.query()`` and 0.5 ms sleeps.

Medians (and the slowest) of 10 writes after one warm-up, for NIXL (the engine that notifies).

``python -m benchmarks.post_cost [target GPU] [MiB ...]``
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import threading
import time

import numpy as np
import torch
import zmq

from kvplan.tools.target_process import target_process
from kvplan.transport.engines import make_engine

DEADLINE = 60.0
MODES = ("quiet", "polling", "computing", "yielding", "yield+notes", "yield+state", "spinning", "sleeping",
         "beside a sync", "beside a query")
WAIT_S = 0.002
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
        for _, note in engine.notifications():
            conn.send((note, time.perf_counter()))
        if conn.poll(0) and conn.recv() == "bye":
            return


class _Computing:
    """A thread that keeps GPU 0 busy with bf16 matmuls on a stream of its own, ``batch`` at a time,
    waiting for each batch (``stream.synchronize()``, or ``event.query()`` and short sleeps), until
    stopped (a forward pass beside the sender)."""

    def __init__(self, dim: int = 8192, batch: int = 4, query: bool = False):
        self.x = torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16)
        self.batch, self.query = batch, query
        self.stream, self.stop = torch.cuda.Stream(), threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        while not self.stop.is_set():
            with torch.cuda.stream(self.stream):
                for _ in range(self.batch):
                    torch.mm(self.x, self.x)
                done = torch.cuda.Event()
                done.record()
            if self.query:
                while not done.query():
                    time.sleep(0.0005)
            else:
                self.stream.synchronize()

    def __enter__(self) -> "_Computing":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def _beside(mode: str):
    """What else the process runs while it posts, by mode: a thread computing, or nothing."""
    if mode == "computing":
        return _Computing()
    if mode.startswith("beside"):
        return _Computing(batch=64, query=mode.endswith("query"))
    return contextlib.nullcontext()


def _before(mode: str, engine, word: torch.Tensor, socket, last=None) -> None:
    """What the sender does for ``WAIT_S`` before the post, by mode (``last``: the last write's handle)."""
    until = time.perf_counter() + WAIT_S
    if mode == "polling":
        while time.perf_counter() < until:
            engine.notifications()
    elif mode.startswith("yield") or mode.startswith("beside"):
        warmed = 0.0
        while int(word[0]) == 0 and (now := time.perf_counter()) < until:
            time.monotonic()
            socket.poll(0)
            if mode == "yield+notes" and now - warmed > 100e-6:
                engine.notifications()
                warmed = now
            elif mode == "yield+state" and last is not None:
                engine.agent.check_xfer_state(last)
            os.sched_yield()
    elif mode == "spinning":
        while time.perf_counter() < until:
            pass
    elif mode == "sleeping":
        time.sleep(WAIT_S)


def _python_step(local: int, remote: int) -> bool:
    """What a post does in Python before the engine's call: a region array made and compared."""
    region = np.array([[local, remote, 8 << 20]], np.uint64)
    descs = np.ascontiguousarray(region, dtype=np.uint64)
    return bool(np.array_equal(descs, region)) and int(descs[:, 2].sum()) > 0


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
        socket = zmq.Context.instance().socket(zmq.PAIR)  # never connected: a poll that finds nothing
        word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        for mib, mode in [(m, p) for m in sizes for p in MODES]:
            with _beside(mode):
                descs = np.array([[src.data_ptr(), remote, mib << 20]], np.uint64)
                posts, dones, notes = [], [], []
                last = None
                for rep in range(11):
                    note = f"w{mib}-{rep}".encode()
                    _before(mode, engine, word, socket, last)
                    t0 = time.perf_counter()
                    handle = engine.post(peer, descs, note, reuse=("slot", 0, mib))
                    t1 = time.perf_counter()
                    last = handle.native
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
            print(f"| {mib} | {mode} | {us(posts)} | {us(dones)} | {us(notes)} | {rate:.1f} |", flush=True)
        print("\nhost time of a Python step of the same kind (a region built and compared, no engine), us")
        print("| after | step |\n|---|---|")
        for mode in (m for m in MODES if m != "computing" and not m.startswith("beside")):
            steps = []
            for rep in range(11):
                _before(mode, engine, word, socket)
                t0 = time.perf_counter()
                _python_step(src.data_ptr(), remote)
                if rep:
                    steps.append(time.perf_counter() - t0)
            print(f"| {mode} | {statistics.median(steps) * 1e6:.1f} ({max(steps) * 1e6:.1f}) |", flush=True)
        socket.close(0)


if __name__ == "__main__":
    main()
