"""The checksum kernel's speed (kvplan.kernels.checksum) on a GPU, against a device-to-device copy of
the same bytes (what the card's memory moves), for descriptors of several sizes over 256 MiB, unkeyed
and keyed (every slot under a key, as with a shared secret).

``python -m benchmarks.checksum_bandwidth`` (GPU; kernels compiled: TRITON_INTERPRET=0).
"""

from __future__ import annotations

import torch

from kvplan.kernels.checksum import checksum_descriptors

SIZE = 256 << 20


def _ms(fn, runs: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(runs):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    data = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, device="cuda")
    copy = torch.empty_like(data)
    copy_ms = _ms(lambda: copy.copy_(data))
    print(f"device copy of 256 MiB: {copy_ms:.3f} ms, {2 * SIZE / copy_ms / 1e6:.0f} GB/s read+write "
          f"({SIZE / copy_ms / 1e6:.0f} GB/s of bytes)")
    for piece in (520, 39_290, 4 << 20):
        n = SIZE // piece
        at = torch.arange(n, dtype=torch.int64, device="cuda") * piece
        descs = torch.stack([data.data_ptr() + at, (1 << 44) + at, torch.full_like(at, piece)], dim=1).contiguous()
        owners = (torch.arange(n, device="cuda") % 64).to(torch.int64)
        out = torch.zeros(64, dtype=torch.int64, device="cuda")
        keys = torch.stack([torch.randint(0, 1 << 32, (64,), device="cuda"), torch.randint(0, 1 << 32, (64,), device="cuda"),
                            torch.ones(64, dtype=torch.int64, device="cuda")], dim=1).contiguous()
        for name, table in (("unkeyed", None), ("keyed", keys)):
            ms = _ms(lambda: checksum_descriptors(descs, owners, out.zero_(), typical_bytes=piece, keys=table))
            print(f"checksum ({name}) of 256 MiB in {n} descriptors of {piece} B: {ms:.3f} ms, "
                  f"{n * piece / ms / 1e6:.0f} GB/s ({100 * copy_ms / ms:.0f}% of the copy's byte rate)")


if __name__ == "__main__":
    main()
