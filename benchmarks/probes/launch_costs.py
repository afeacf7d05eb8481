"""Host cost of the launches a staged send makes, on an idle GPU: what one call of each takes on
the calling thread (median of 200), on the current stream and on a transport stream.

    PYTHONPATH=. TRITON_INTERPRET=0 python3 -m benchmarks.probes.launch_costs

Answer (one H200, session 14, results/archive/): a torch launch costs 20-27 us of host time and the gather's Triton launch 23-36 us; inside the two-process demo the same steps take 2-5x that, for a cause not found.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kvplan.transport.local import gather
from kvplan.transport.streams import transport_stream


def host_us(fn, runs: int = 200) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return float(np.median(times) * 1e6)


def main() -> None:
    dev = torch.device("cuda")
    staging = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
    src = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
    n = 8192
    descs = torch.zeros(n, 3, dtype=torch.int64, device=dev)
    descs[:, 0] = src.data_ptr() + torch.arange(n, device=dev) * 4096
    descs[:, 2] = 4096
    sizes = descs[:, 2]
    out = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    rows = torch.tensor([n], dtype=torch.int64, device=dev)
    side = transport_stream(dev)
    torch_side = torch.cuda.Stream(dev)
    event = torch.cuda.Event()
    steps = {
        "cumsum (strided column, new tensor)": lambda: torch.cumsum(sizes, 0),
        "cumsum into a kept buffer": lambda: torch.cumsum(sizes, 0, out=out[1:]),
        "cumsum then sub_": lambda: torch.cumsum(sizes, 0).sub_(sizes),
        "gather launch (counted window)": lambda: gather(descs, out[:n], staging, 16, 4096, need=32 << 20,
                                                         window=(0, 32 << 20), rows=rows),
        "gather launch (plain)": lambda: gather(descs, out[:n], staging, 16, 4096, need=32 << 20),
        "event record": lambda: event.record(),
        "event query": lambda: event.query(),
    }
    for name, fn in steps.items():
        fn()
        plain = host_us(fn)
        with torch.cuda.stream(side):
            fn()
            on_side = host_us(fn)
        with torch.cuda.stream(torch_side):
            on_torch_side = host_us(fn)
        print(f"{name:40s} current {plain:7.1f} us   transport stream {on_side:7.1f} us   torch stream "
              f"{on_torch_side:7.1f} us")

    def enter_exit():
        with torch.cuda.stream(side):
            pass
    print(f"{'enter/exit torch.cuda.stream(transport)':40s} {host_us(enter_exit):7.1f} us")


if __name__ == "__main__":
    main()
