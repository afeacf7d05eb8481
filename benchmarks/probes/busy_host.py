"""Why ``plan()`` returns slower when the stream is busy: host work timed on an idle GPU and right
after a queued ``torch.cuda._sleep`` (the busy-return target). Each workload runs 30 times per
condition; medians in microseconds. The last condition keeps the thread busy for 2 ms after queuing
the sleep, as a scheduler's thread would be (it did not help on the H100 of session 8). Workloads: a pure-Python loop and a NumPy copy into pinned
memory (no CUDA at all), one small kernel launch, and ``Planner.plan`` of ``qwen3next-mamba-p64``.

Usage on a GPU machine:  PYTHONPATH=. TRITON_INTERPRET=0 python3 -m benchmarks.probes.busy_host

Answer (H100 and H200, sessions 8 and 17, results/archive/): it is the host's, not kvplan's. A NumPy copy into pinned memory, which makes no CUDA call, slows 7-10x right after a kernel is queued and as much after the host merely slept; `plan()` slows with it (66 -> 187 us).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
import torch

from kvplan.planner.device.columns import BatchColumns
from kvplan.planner.device.planner import Planner
from kvplan.tools.scenarios import PRESETS, build_batch


def python_loop() -> None:
    total = 0
    for i in range(3000):
        total += i * i


def main() -> None:
    dev = torch.device("cuda")
    cycles = int(20e-3 * torch.cuda.get_device_properties(dev).clock_rate * 1e3)
    pinned = torch.empty(1 << 15, dtype=torch.int64, pin_memory=True)
    src = np.arange(1 << 15, dtype=np.int64)
    x = torch.zeros(1024, device=dev)
    batch = build_batch(PRESETS["qwen3next-mamba-p64"], 64, 4096).to(dev)
    cols = BatchColumns.from_batch(batch)
    planner = Planner(batch.src, batch.dsts)
    for _ in range(5):
        planner.plan(cols).descriptors()
    side = torch.cuda.Stream(dev)
    work = {
        "python loop": python_loop,
        "numpy copy into pinned": lambda: pinned.numpy().__setitem__(slice(None), src),
        "one kernel launch": lambda: x.add_(1),
        "plan()": lambda: planner.plan(cols),
    }
    out = {"card": torch.cuda.get_device_name(dev)}
    for name, fn in work.items():
        row = {}
        for cond in ("idle", "sleep queued", "sleep on another stream", "idle, after 20 ms of sleep(0)",
                     "sleep queued, thread busy 2 ms first"):
            times = []
            for _ in range(30):
                torch.cuda.synchronize()
                if cond == "sleep queued":
                    torch.cuda._sleep(cycles)
                elif cond == "sleep on another stream":
                    with torch.cuda.stream(side):
                        torch.cuda._sleep(cycles)
                elif cond.startswith("idle, after"):
                    time.sleep(0.02)
                if cond.endswith("busy 2 ms first"):  # as a scheduler's thread is: working, not waiting
                    torch.cuda._sleep(cycles)
                    spin_until = time.perf_counter() + 2e-3
                    while time.perf_counter() < spin_until:
                        pass
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
            row[cond] = round(statistics.median(times) * 1e6, 1)
        out[name] = row
        print(name, row, flush=True)
    json.dump(out, sys.stdout)
    print()


if __name__ == "__main__":
    main()
