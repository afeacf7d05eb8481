"""The checksum kernel against its NumPy reference on fresh random bytes, and the properties the
transport relies on: any cut of the same bytes gives the same sum, and one changed byte changes it."""

import numpy as np
import pytest
import torch

from kvplan.kernels import require_runnable
from kvplan.kernels.checksum import MASK, checksum_descriptors, reference_checksum

DEVICE = "cuda" if torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") == "0" else "cpu"


def _sums(buffer: torch.Tensor, pieces: list[tuple[int, int, int, int]], slots: int, typical: int = 4096,
          keys: list[tuple[int, int] | None] | None = None) -> list[int]:
    """Checksums of ``(offset, key, nbytes, slot)`` pieces of ``buffer`` (each slot under ``keys[slot]``, or
    unkeyed where that is ``None``; ``keys`` ``None``: the launch without a key table)."""
    descs = torch.tensor([[buffer.data_ptr() + o, key, n] for o, key, n, _ in pieces], dtype=torch.int64,
                         device=buffer.device)
    owners = torch.tensor([s for *_, s in pieces], dtype=torch.int64, device=buffer.device)
    out = torch.zeros(slots, dtype=torch.int64, device=buffer.device)
    table = None if keys is None else torch.tensor([[*k, 1] if k is not None else [0, 0, 0] for k in keys],
                                                   dtype=torch.int64, device=buffer.device)
    checksum_descriptors(descs, owners, out, typical_bytes=typical, keys=table)
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


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_keyed_slots_equal_the_reference_beside_unkeyed_ones_on_random_bytes_and_cuts(seed):
    """One launch with a key table: slots 0 and 2 keyed (fresh random keys), slot 1 unkeyed; each equals the
    reference, the unkeyed one as the launch without keys gives it, and any cut gives the same sums."""
    require_runnable(DEVICE)
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, 30_000, dtype=np.uint8)
    buffer = torch.from_numpy(data).to(DEVICE)
    where = int(rng.integers(1 << 40, 1 << 47))
    keys = [tuple(int(k) for k in rng.integers(0, 1 << 32, 2)), None, tuple(int(k) for k in rng.integers(0, 1 << 32, 2))]
    cuts = np.sort(rng.choice(np.arange(1, len(data)), size=int(rng.integers(3, 30)), replace=False))
    bounds = [0, *cuts.tolist(), len(data)]
    pieces = [(lo, where + lo, hi - lo, k % 3) for k, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
    typical = int(rng.choice([64, 1000, 8192]))
    got = _sums(buffer, pieces, 3, typical=typical, keys=keys)
    want = [sum(reference_checksum(data[lo : lo + n], k, keys[slot]) for lo, k, n, s in pieces if s == slot) & MASK
            for slot in range(3)]
    assert got == want
    assert got[1] == _sums(buffer, pieces, 3, typical=typical)[1]
    for slot in (0, 2):  # the whole of the bytes, uncut, under the same key
        whole = [(lo, where + lo, n, 0) for lo, _, n, s in pieces if s == slot]
        assert _sums(buffer, whole, 1, keys=[keys[slot]])[0] == got[slot]


def test_the_keyed_checksum_holds_its_golden_values():
    """The definition pinned (a sender and a receiver of different builds must agree): 64 bytes at a fixed
    address, unkeyed and under a fixed key."""
    require_runnable(DEVICE)
    data = (np.arange(64) * 37 % 256).astype(np.uint8)
    where = 0x7F00_1234_5678
    assert reference_checksum(data, where) == 0x54791EC0
    assert reference_checksum(data, where, (0x01234567, 0x89ABCDEF)) == 0xD9A86AFA
    buffer = torch.from_numpy(data).to(DEVICE)
    assert _sums(buffer, [(0, where, 64, 0), (0, where, 64, 1)], 2, keys=[(0x01234567, 0x89ABCDEF), None]) == [
        0xD9A86AFA, 0x54791EC0]


def test_changes_that_cancel_in_the_unkeyed_sum_change_every_keyed_one():
    """The unkeyed checksum is public and nearly linear in the address, so a writer can change
    bytes without changing it (1, -1, -1, 1 added to an aligned group of four). Under a key the same change
    is seen, for every key tried; one changed byte is seen under every key too."""
    require_runnable(DEVICE)
    rng = np.random.default_rng(11)
    data = rng.integers(2, 250, 4096).astype(np.uint8)
    forged = data.copy()
    forged[1024:1028] = (forged[1024:1028].astype(np.int64) + np.array([1, -1, -1, 1])).astype(np.uint8)
    one = data.copy()
    one[77] ^= 0x80
    where = 1 << 40
    pieces = [(0, where, 4096, 0)]
    buffers = [torch.from_numpy(x.copy()).to(DEVICE) for x in (data, forged, one)]
    assert _sums(buffers[0], pieces, 1) == _sums(buffers[1], pieces, 1)  # (the weakness, unkeyed)
    for _ in range(8):
        key = tuple(int(k) for k in rng.integers(0, 1 << 32, 2))
        sums = [_sums(b, pieces, 1, keys=[key])[0] for b in buffers]
        assert sums[0] != sums[1] and sums[0] != sums[2], key
