"""An engine's own ceiling on this machine: one contiguous WRITE between two processes.

``python -m benchmarks.engine_ceiling nixl|mooncake [MiB] [target GPU] [pieces] [KEY=VALUE ...]``: the
engine's own settings last (``protocol=nvlink_intra`` for Mooncake between two cards); GPU memory (VRAM) when a
GPU is present; the target buffer on another card when a target GPU is named (two-card runs). With
``pieces`` > 1 the same bytes go as that many equal descriptors in one write: the engine's ceiling for a
batch of that many descriptors (Mooncake spreads the descriptors of a batch over its TCP lanes). The median of 5 writes after one warm-up, in GiB/s, next to which kvplan's end-to-end
numbers (``kvplan demo``) are read.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

from kvplan.tools.target_process import target_process
from kvplan.transport.engines import make_engine, write

DEADLINE = 60.0


def _setting(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    return key, int(value) if value.lstrip("-").isdigit() else value


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _loopback(kind: str) -> dict:
    """This tool measures on one host: Mooncake is told 127.0.0.1 (NIXL's UCX: UCX_NET_DEVICES=lo, set by python -m benchmarks)."""
    return {"local_hostname": "127.0.0.1"} if kind == "mooncake" else {}


def target(kind: str, size: int, gpu: int, settings: dict, conn) -> None:
    device = _device()
    if device == "cuda" and gpu:
        torch.cuda.set_device(gpu)
        device = f"cuda:{gpu}"
    engine = make_engine(kind, "ceiling-target", "VRAM" if _device() == "cuda" else "DRAM",
                         **({"device_id": gpu} if gpu else {}), **_loopback(kind), **settings)
    buf = torch.zeros(size, dtype=torch.uint8, device=device)
    engine.register([(buf.data_ptr(), size)])
    conn.send((engine.metadata(), buf.data_ptr()))
    conn.poll(DEADLINE * 4)


def main() -> None:
    numbers = [a for a in sys.argv[2:] if "=" not in a]
    settings = dict(_setting(a) for a in sys.argv[2:] if "=" in a)
    kind = sys.argv[1]
    size = int(numbers[0] if numbers else 256) << 20
    gpu = int(numbers[1]) if len(numbers) > 1 else 0
    pieces = int(numbers[2]) if len(numbers) > 2 else 1
    with target_process(target, kind, size, gpu, settings) as (_, (metadata, remote)):
        engine = make_engine(kind, "ceiling-initiator", "VRAM" if _device() == "cuda" else "DRAM", **_loopback(kind),
                             **settings)
        src = torch.ones(size, dtype=torch.uint8, device=_device())
        engine.register([(src.data_ptr(), size)])
        peer = engine.connect(metadata)
        piece = size // pieces
        at = np.arange(pieces, dtype=np.uint64) * np.uint64(piece)
        descs = np.stack([np.uint64(src.data_ptr()) + at, np.uint64(remote) + at,
                          np.full(pieces, piece, np.uint64)], axis=1)
        times = []
        for i in range(6):
            t0 = time.perf_counter()
            write(engine, peer, descs, b"ceiling", time.monotonic() + DEADLINE)
            if i:
                times.append(time.perf_counter() - t0)
        gibs = piece * pieces / statistics.median(times) / 2**30
        where = f", GPU 0 to GPU {gpu}" if gpu and _device() == "cuda" else ""
        what = "one contiguous write" if pieces == 1 else f"one write of {pieces} descriptors of {piece} B"
        how = "".join(f" {k}={v}" for k, v in settings.items())
        print(f"{kind}{how} ceiling, {what}, {size >> 20} MiB, {_device()} memory{where}: {gibs:.2f} GiB/s")


if __name__ == "__main__":
    main()
