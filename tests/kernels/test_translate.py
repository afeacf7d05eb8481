"""The ipc engine's one launch: the copy kernel with ``translate`` against kvplan.kernels.translate's
NumPy definition, on fresh random regions and descriptors (inside one region, straddling two, outside
all, negative sizes), large and small (tile) descriptors; and golden vectors. Destinations are in a
made-up peer address space; the regions map them onto a real buffer, so a descriptor the kernel got
wrong writes where the test looks (or faults), and a flagged one must write nothing."""

import numpy as np
import pytest
import torch

from kvplan.kernels import require_runnable
from kvplan.kernels.copy import DIRECT, copy_descriptors
from kvplan.kernels.translate import reference_translate

DEVICE = "cuda" if torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") == "0" else "cpu"
PEER = 1 << 40  # where the peer's made-up addresses start


def _copy(src: torch.Tensor, mapped: torch.Tensor, descs: np.ndarray, regions: np.ndarray, typical: int):
    """Run the translated copy; (the mapped buffer after it, flags, count)."""
    d = torch.from_numpy(descs.astype(np.int64)).to(DEVICE)
    r = torch.from_numpy(regions.astype(np.int64)).to(DEVICE)
    flags = torch.full((len(descs),), 9, dtype=torch.int8, device=DEVICE)  # (poisoned: every row written)
    bad = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    copy_descriptors(d, DIRECT, alignment=1, typical_bytes=typical, translate=(r, flags, bad))
    return mapped.cpu().numpy(), flags.cpu().numpy(), int(bad.item())


def _case(rng: np.random.Generator, n: int, r: int, size_max: int, src: torch.Tensor, mapped: torch.Tensor):
    """Regions tiling ``mapped`` with gaps between them (in peer space), and ``n`` descriptors of every kind."""
    cuts = np.sort(rng.choice(np.arange(1, mapped.numel() // 64), size=r - 1, replace=False)) * 64 if r > 1 else []
    bounds = [0, *list(cuts), mapped.numel()]
    lengths = np.diff(bounds)
    peer_lo = PEER + np.cumsum(np.concatenate([[0], lengths[:-1] + rng.integers(1, 1 << 12, r - 1)])) if r > 1 \
        else np.array([PEER])
    regions = np.stack([peer_lo, peer_lo + lengths, mapped.data_ptr() + np.array(bounds[:-1])], axis=1)
    k = rng.integers(0, r, n)
    kind = rng.integers(0, 6, n)
    size = np.minimum(rng.integers(1, size_max, n), lengths[k])
    dst = peer_lo[k] + rng.integers(0, np.maximum(lengths[k] - size, 1))
    dst = np.where(kind == 1, peer_lo[k] + lengths[k] - size // 2, dst)                 # straddles its end
    dst = np.where(kind == 2, PEER - rng.integers(1, 1 << 20, n), dst)                    # below every region
    dst = np.where(kind == 3, regions[-1, 1] + rng.integers(0, 1 << 20, n), dst)          # above every region
    size = np.where(kind == 4, -rng.integers(1, 100, n), size)                             # a negative size
    sources = src.data_ptr() + rng.integers(0, src.numel() - size_max, n)
    descs = np.stack([sources, dst, size], axis=1)
    # no two writes overlap (a plan guarantees it): keep the first of any that would
    keep, taken = [], np.zeros(mapped.numel(), bool)
    out, flags = reference_translate(descs, regions)
    for i in range(n):
        lo = int(out[i, 1]) - mapped.data_ptr()
        if flags[i] or not taken[lo : lo + int(out[i, 2])].any():
            keep.append(i)
            if not flags[i]:
                taken[lo : lo + int(out[i, 2])] = True
    return descs[keep], regions


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_translated_copy_equals_the_reference_on_random_descriptors(seed):
    require_runnable(DEVICE)
    rng = np.random.default_rng()  # fresh inputs every run; the seed picks the shape
    r, size_max, typical = [(1, 64, 32), (3, 4096, 4096), (9, 512, 128), (15, 70000, 65536)][seed]
    src = torch.randint(0, 256, (1 << 18,), dtype=torch.uint8, device=DEVICE)
    mapped = torch.zeros(1 << 18, dtype=torch.uint8, device=DEVICE)
    descs, regions = _case(rng, int(rng.integers(20, 200)), r, size_max, src, mapped)
    got, flags, bad = _copy(src, mapped, descs, regions, typical)
    want_out, want_flags = reference_translate(descs, regions)
    np.testing.assert_array_equal(flags, want_flags)
    assert bad == int(want_flags.sum()) and 0 < bad < len(descs)
    want = np.zeros(mapped.numel(), np.uint8)
    host = src.cpu().numpy()
    for s, d, n in want_out[want_flags == 0]:
        lo = int(d) - mapped.data_ptr()
        want[lo : lo + int(n)] = host[int(s) - src.data_ptr() : int(s) - src.data_ptr() + int(n)]
    np.testing.assert_array_equal(got, want)


def test_golden_vectors():
    require_runnable(DEVICE)
    src = torch.arange(256, dtype=torch.int32, device=DEVICE).to(torch.uint8)
    mapped = torch.zeros(1200, dtype=torch.uint8, device=DEVICE)
    base, s = mapped.data_ptr(), src.data_ptr()
    regions = np.array([[1000, 2000, base], [3000, 3100, base + 1000]])
    descs = np.array([
        [s, 1000, 16],        # the first region's start
        [s + 16, 1999, 2],    # straddles its end
        [s, 2500, 8],         # between the two
        [s + 32, 3050, 50],   # the end of the second
        [s, 999, 1],          # below both
        [s, 3000, -1],        # a negative size
        [s, 3100, 0],         # empty, at the second's end: inside, nothing to write
    ])
    got, flags, bad = _copy(src, mapped, descs, regions, 64)
    assert flags.tolist() == [0, 1, 1, 0, 1, 1, 0] and bad == 4
    want = np.zeros(1200, np.uint8)
    want[0:16] = np.arange(16)
    want[1050:1100] = np.arange(32, 82)
    np.testing.assert_array_equal(got, want)
    out, ref_flags = reference_translate(descs, regions)
    assert ref_flags.tolist() == flags.tolist() and out[3].tolist() == [s + 32, base + 1050, 50]
