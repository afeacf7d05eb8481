"""The ``ipc`` engine's one launch against a device copy of the same bytes, on one GPU (issue 55, item 5).

``python -m benchmarks.ipc_copy [--shapes COUNTxBYTES ...] [--repeat N]``: a receiver process holds a
pool on GPU 0 and registers it with the ipc engine; this process writes ``COUNT`` descriptors of
``BYTES`` each into it, to fragmented places (a random permutation of pool slots), through
``IpcEngine.post_device`` (the translate-and-check kernel and the copy kernel, one post), and compares:

* ``copy``: one contiguous device copy of the same number of bytes in this process (``dst.copy_(src)``);
* ``local``: the same descriptors through the copy kernel into this process's own memory;
* ``ipc``: the post into the other process, from the call to its launch's event (host wall clock around a
  synchronised device, as ``copy`` is timed), first post apart from the steady median;

and the same three in device time alone (events, with the stream held by a sleep while the host enqueues).

Every byte is checked after the runs: the ipc engine's own mapping of the receiver's pool is read back
with the copy kernel and compared with the source on the device. Prints one row per shape.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvplan.kernels.copy import DIRECT, copy_descriptors
from kvplan.tools.target_process import target_process
from kvplan.transport.engines import make_engine

SHAPES = ("6832x39296", "409600x4096", "10485760x256")  # llama70b's batch; vLLM-sized blocks; head slices


def _receiver(pool_bytes: int, conn) -> None:
    engine = make_engine("ipc", "bench-receiver", "VRAM", 0)
    pool = torch.zeros(pool_bytes, dtype=torch.uint8, device="cuda")
    engine.register([(pool.data_ptr(), pool_bytes)])
    conn.send((engine.metadata(), pool.data_ptr()))
    conn.poll(1200)
    engine.close()


def _median_s(run, repeat: int) -> tuple[float, float]:
    """(first, median of the rest) seconds of ``run()`` between two synchronisations."""
    times = []
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[1:])


def _device_s(run, repeat: int) -> float:
    """Median device seconds of ``run()`` (which enqueues on the current stream, or on a stream that waits
    on it and that it makes the current stream wait on): the stream is held by a sleep while the host
    enqueues, so the time between the two events is the device's alone."""
    stream, times = torch.cuda.current_stream(), []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # (about 1 ms: longer than the host's launches)
        start.record(stream)
        run()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    pool_bytes = max(c * b for c, b in shapes)
    rows, device_rows = [], []
    with target_process(_receiver, pool_bytes, start_s=120) as (_, (metadata, remote)):
        engine = make_engine("ipc", "bench-sender", "VRAM", 0)
        src = torch.randint(0, 256, (pool_bytes,), dtype=torch.uint8, device="cuda")
        local = torch.empty_like(src)
        engine.register([(src.data_ptr(), pool_bytes)])
        peer = engine.connect(metadata)
        for count, size in shapes:
            nbytes = count * size
            slots = torch.randperm(count, device="cuda", dtype=torch.int64)
            offsets = torch.arange(count, device="cuda", dtype=torch.int64) * size
            sizes = torch.full((count,), size, device="cuda", dtype=torch.int64)
            remote_descs = torch.stack([src.data_ptr() + offsets, remote + slots * size, sizes], 1).contiguous()
            local_descs = torch.stack([src.data_ptr() + offsets, local.data_ptr() + slots * size, sizes], 1).contiguous()
            align = size & -size
            first_copy, copy_s = _median_s(lambda: local[:nbytes].copy_(src[:nbytes]), args.repeat)
            _, local_s = _median_s(lambda: copy_descriptors(local_descs, DIRECT, alignment=align, typical_bytes=size),
                                   args.repeat)

            def post() -> None:
                handle = engine.post_device(peer, remote_descs, [b""], [(0, count)], alignment=align,
                                            typical_bytes=size)[0]
                handle.native[0].event.synchronize()
                assert engine.progress(handle) == "DONE", handle.error

            first_ipc, ipc_s = _median_s(post, args.repeat)

            def post_queued() -> None:
                handle = engine.post_device(peer, remote_descs, [b""], [(0, count)], alignment=align,
                                            typical_bytes=size)[0]
                torch.cuda.current_stream().wait_event(handle.native[0].event)

            device = (_device_s(lambda: local[:nbytes].copy_(src[:nbytes]), args.repeat),
                      _device_s(lambda: copy_descriptors(local_descs, DIRECT, alignment=align, typical_bytes=size),
                                args.repeat),
                      _device_s(post_queued, args.repeat))
            # every byte: the receiver's pool read back through this process's mapping of it
            table = engine._table(engine._peers[peer])
            mapped = int(table[0, 2])
            back = torch.stack([mapped + slots * size, local.data_ptr() + offsets, sizes], 1).contiguous()
            local.zero_()
            copy_descriptors(back, DIRECT, alignment=align, typical_bytes=size)
            ok = bool(torch.equal(local[:nbytes], src[:nbytes]))
            gib = nbytes / 2**30
            rows.append((count, size, nbytes, gib / copy_s, gib / local_s, gib / ipc_s, ipc_s / copy_s,
                         first_ipc * 1e3, ok))
            device_rows.append((count, size, *(gib / t for t in device)))
        engine.close()
    print(f"{'descriptors':>12} {'bytes each':>10} {'MB':>8} {'copy GiB/s':>11} {'local GiB/s':>11} "
          f"{'ipc GiB/s':>10} {'ipc/copy':>9} {'first ms':>9} checked")
    for count, size, nbytes, copy_r, local_r, ipc_r, ratio, first_ms, ok in rows:
        print(f"{count:>12,} {size:>10,} {nbytes / 1e6:>8.1f} {copy_r:>11.1f} {local_r:>11.1f} {ipc_r:>10.1f} "
              f"{copy_r and ipc_r / copy_r:>9.1%} {first_ms:>9.2f} {'every byte' if ok else 'MISMATCH'}")
    print("device time alone (events, the stream held while the host enqueues):")
    print(f"{'descriptors':>12} {'bytes each':>10} {'copy GiB/s':>11} {'local GiB/s':>11} {'ipc GiB/s':>10} {'ipc/copy':>9}")
    for count, size, copy_r, local_r, ipc_r in device_rows:
        print(f"{count:>12,} {size:>10,} {copy_r:>11.1f} {local_r:>11.1f} {ipc_r:>10.1f} {ipc_r / copy_r:>9.1%}")


if __name__ == "__main__":
    main()
