"""Plan latency after the GPU has been idle: a graph-replayed plan of the llama70b staged batch
(llama70b-tp8-p64, 8 layers, 8 x 8192 tokens) from the call to its event done, back to back and
after idle gaps, with the host spinning on the event (as the transport's loops do).

    PYTHONPATH=. TRITON_INTERPRET=0 python3 -m benchmarks.probes.plan_idle

Answer (one H200, session 14, results/archive/): a graph-replayed plan of this batch is ready 73-144 us after the call, slower after idle gaps.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kvplan.planner.device.planner import Planner
from kvplan.tools.scenarios import PRESETS, build_batch


def main() -> None:
    batch = build_batch(PRESETS["llama70b-tp8-p64"].scaled(layers=8), 8, 8192).to(torch.device("cuda"))
    planner = Planner(batch.src, batch.dsts, outputs=("descriptors",))
    for _ in range(5):
        planner.plan(batch).descriptors()
    busy = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    for gap_ms in (0, 1, 3, 10, 30):
        ready, host = [], []
        for _ in range(60):
            if gap_ms:
                end = time.perf_counter() + gap_ms / 1e3
                while time.perf_counter() < end:
                    pass
            t0 = time.perf_counter()
            pending = planner.plan(batch)
            t1 = time.perf_counter()
            while not pending.ready():
                pass
            ready.append(time.perf_counter() - t0)
            host.append(t1 - t0)
            pending.descriptors()
        print(f"idle {gap_ms:3d} ms before: plan() host {np.median(host) * 1e6:6.1f} us, to ready "
              f"median {np.median(ready) * 1e6:6.1f} us, p90 {np.percentile(ready, 90) * 1e6:6.1f} us")
    # the same right after a 256 MiB device copy was queued (the GPU busy with another stream's copy)
    side = torch.cuda.Stream()
    ready = []
    for _ in range(60):
        with torch.cuda.stream(side):
            busy.add_(1)
        t0 = time.perf_counter()
        pending = planner.plan(batch)
        while not pending.ready():
            pass
        ready.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    print(f"behind a 256 MiB elementwise pass on another stream: to ready median {np.median(ready) * 1e6:6.1f} us")


if __name__ == "__main__":
    main()
