"""What launching a staged wave's scatter costs the receiver's host, as a freshly captured graph.

A streamed wave's scatter is captured as a CUDA graph when its table arrives and replayed once,
when its bytes land (docs/layerwise.md §3). This times the host side of that launch (replay plus
the event recorded behind it) for scatters of ``pages`` descriptors of ``page_bytes`` each:

* ``first``: a graph replayed for the first time (what every streamed wave does today);
* ``uploaded``: a graph replayed for the first time after ``cuGraphUpload`` on its stream, done
  when it was captured;
* ``again``: a graph replayed a second time;
* ``kernel``: the scatter launched from the host, no graph.

Medians (and the slowest) of 20 graphs after one warm-up, in microseconds.

``python -m benchmarks.graph_launch [pages page_bytes ...]``
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kvplan.transport.copy_graphs import capture_copy, upload_graph
from kvplan.transport.local import scatter, warm_up
from kvplan.transport.streams import transport_stream

CASES = ((256, 32768), (2048, 4096))  # llama70b's last group of 2 layers (pages of 64 tokens); small pages
REPS = 20


def _launch(stream: torch.cuda.Stream, run) -> float:
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        run()
        event = torch.cuda.Event()
        event.record(stream)
    t1 = time.perf_counter()
    event.synchronize()
    return t1 - t0


def main() -> None:
    args = [int(x) for x in sys.argv[1:]]
    cases = list(zip(args[::2], args[1::2])) or list(CASES)
    device = torch.device("cuda", 0)
    stream, capture_stream = transport_stream(device), transport_stream(device)
    print("host time of one scatter launch, us: median (slowest) of", REPS)
    print("| pages | page bytes | first replay | first replay, uploaded | replayed again | kernel |")
    print("|---|---|---|---|---|---|")
    for pages, page_bytes in cases:
        staging = torch.zeros(pages * page_bytes, dtype=torch.uint8, device=device)
        pool = torch.zeros(2 * pages * page_bytes, dtype=torch.uint8, device=device)
        warm_up(staging)
        order = torch.randperm(2 * pages, device=device)[:pages]  # scattered pages, as a pool has them
        descs = torch.stack([torch.zeros_like(order), pool.data_ptr() + order * page_bytes,
                             torch.full_like(order, page_bytes)], dim=1)
        offsets = torch.arange(pages, device=device, dtype=torch.int64) * page_bytes
        run = lambda: scatter(descs, offsets, staging, 16, typical_bytes=page_bytes, need=staging.numel())  # noqa: E731
        times: dict[str, list[float]] = {"first": [], "uploaded": [], "again": [], "kernel": []}
        for rep in range(REPS + 1):
            fresh, uploaded = capture_copy(run, capture_stream, "scatters"), capture_copy(run, capture_stream, "scatters")
            assert fresh is not None and uploaded is not None
            upload_graph(uploaded, stream)
            stream.synchronize()
            first, up = _launch(stream, fresh.replay), _launch(stream, uploaded.replay)
            again, kernel = _launch(stream, fresh.replay), _launch(stream, run)
            if rep:
                for key, value in zip(times, (first, up, again, kernel)):
                    times[key].append(value)
        us = lambda xs: f"{statistics.median(xs) * 1e6:.0f} ({max(xs) * 1e6:.0f})"  # noqa: E731
        print(f"| {pages} | {page_bytes} | " + " | ".join(us(times[k]) for k in times) + " |", flush=True)


if __name__ == "__main__":
    main()
