"""The physical ceiling of a GPU-to-GPU write: a torch copy (``dst.copy_(src)``) from GPU 0 to
GPU 1 (a peer copy over NVLink), or on a machine with one GPU from GPU 0 to GPU 0; the median of 5
after one warm-up, in GiB/s. Read next to the engines' ceilings (``benchmarks.engine_ceiling``)
and kvplan's end-to-end numbers, measured in the same run.

``python -m benchmarks.peer_copy [MiB]``.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def main() -> None:
    size = int(sys.argv[1] if len(sys.argv) > 1 else 256) << 20
    to = 1 if torch.cuda.device_count() > 1 else 0
    src = torch.ones(size, dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(size, dtype=torch.uint8, device=f"cuda:{to}")
    times = []
    for i in range(6):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(to)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(to)
        if i:
            times.append(time.perf_counter() - t0)
    assert bool((dst == 1).all()), "the peer copy did not land"
    peer = f" (peer access: {torch.cuda.can_device_access_peer(0, 1)})" if to else ""
    print(f"torch copy, GPU 0 to GPU {to}, {size >> 20} MiB: {size / statistics.median(times) / 2**30:.2f} GiB/s{peer}")


if __name__ == "__main__":
    main()
