"""The checksum kernel against its NumPy reference on fresh random bytes, and the properties the
transport relies on: any cut of the same bytes gives the same sum, and one changed byte changes it."""

import numpy as np
import pytest
import torch

from kvplan.kernels import require_runnable
from kvplan.kernels.checksum import MASK, checksum_descriptors, reference_checksum

DEVICE = "cuda" if torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") == "0" else "cpu"


def _sums(buffer: torch.Tensor, pieces: list[tuple[int, int, int, int]], slots: int, typical: int = 4096) -> list[int]:
    """Checksums of ``(offset, key, nbytes, slot)`` pieces of ``buffer``."""
    descs = torch.tensor([[buffer.data_ptr() + o, key, n] for o, key, n, _ in pieces], dtype=torch.int64,
                         device=buffer.device)
    owners = torch.tensor([s for *_, s in pieces], dtype=torch.int64, device=buffer.device)
    out = torch.zeros(slots, dtype=torch.int64, device=buffer.device)
    checksum_descriptors(descs, owners, out, typical_bytes=typical)
    return [int(x) & MASK for x in out.cpu()]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_kernel_equals_the_reference_on_random_bytes_and_cuts(seed):
    require_runnable(DEVICE)
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, 50_000, dtype=np.uint8)
    buffer = torch.from_numpy(data).to(DEVICE)
    key = int(rng.integers(1 << 40, 1 << 47))  # where the bytes land (a receiver's address space)
    cuts = np.sort(rng.choice(np.arange(1, len(data)), size=int(rng.integers(1, 40)), replace=False))
    bounds = [0, *cuts.tolist(), len(data)]
    pieces = [(lo, key + lo, hi - lo, k % 3) for k, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
    got = _sums(buffer, pieces, 3, typical=int(rng.choice([64, 1000, 8192])))
    want = [sum(reference_checksum(data[lo : lo + n], k) for lo, k, n, s in pieces if s == slot) & MASK
            for slot in range(3)]
    assert got == want
    whole = _sums(buffer, [(0, key, len(data), 0)], 1)[0]
    assert whole == sum(got) & MASK  # any cut of the same bytes at the same places: the same sum


def test_one_changed_byte_or_one_moved_byte_changes_the_sum():
    require_runnable(DEVICE)
    data = np.arange(4096, dtype=np.int64).astype(np.uint8)
    buffer = torch.from_numpy(data.copy()).to(DEVICE)
    before = _sums(buffer, [(0, 1 << 32, 4096, 0)], 1)[0]
    for at, value in ((0, 1), (4095, 0), (1234, 7)):
        flipped = buffer.clone()
        flipped[at] = value if int(flipped[at]) != value else value + 1
        assert _sums(flipped, [(0, 1 << 32, 4096, 0)], 1)[0] != before
    assert _sums(buffer, [(0, (1 << 32) + 1, 4096, 0)], 1)[0] != before  # the same bytes one address further
