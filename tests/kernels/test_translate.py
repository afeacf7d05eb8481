"""The ipc engine's translate-and-check kernel against its NumPy reference on fresh random regions and
descriptors (inside one region, straddling two, outside all, negative sizes), and golden vectors."""

import numpy as np
import pytest
import torch

from kvplan.kernels import require_runnable
from kvplan.kernels.translate import reference_translate, translate_descriptors

DEVICE = "cuda" if torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") == "0" else "cpu"


def _run(descs: np.ndarray, regions: np.ndarray, in_place: bool = False,
         rows: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    d = torch.from_numpy(descs.astype(np.int64)).to(DEVICE)
    r = torch.from_numpy(regions.astype(np.int64)).to(DEVICE)
    out = d if in_place else torch.full_like(d, -7)  # (poisoned: every row must be written)
    flags = torch.full((len(descs),), 9, dtype=torch.int8, device=DEVICE)
    bad = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    counted = None if rows is None else torch.tensor([rows], dtype=torch.int64, device=DEVICE)
    translate_descriptors(d, r, out, flags, bad, rows=counted)
    return out.cpu().numpy(), flags.cpu().numpy(), int(bad.item())


def _random_case(rng: np.random.Generator, n: int, r: int) -> tuple[np.ndarray, np.ndarray]:
    lengths = rng.integers(1, 1 << 20, r)
    gaps = rng.integers(0, 1 << 16, r)
    lo = (1 << 40) + np.cumsum(gaps + np.concatenate([[0], lengths[:-1]]))
    hi = lo + lengths
    mapped = rng.integers(1 << 44, 1 << 46, r)
    regions = np.stack([lo, hi, mapped], axis=1)
    k = rng.integers(0, r, n)
    kind = rng.integers(0, 6, n)
    size = rng.integers(0, 1 << 12, n)
    start = lo[k] + rng.integers(0, np.maximum(lengths[k] - size, 1))
    dst = np.where(kind == 1, hi[k] - size // 2 - 1, start)            # straddles its region's end
    dst = np.where(kind == 2, lo[0] - rng.integers(1, 1 << 20, n), dst)  # below every region
    dst = np.where(kind == 3, hi[-1] + rng.integers(0, 1 << 20, n), dst)  # above every region
    size = np.where(kind == 4, -rng.integers(1, 100, n), size)            # a negative size
    dst = np.where(kind == 5, lo[k] + lengths[k] - size, dst)             # ends exactly at its region's end
    src = rng.integers(1 << 30, 1 << 34, n)
    return np.stack([src, dst, size], axis=1), regions


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_kernel_equals_the_reference_on_random_descriptors(seed):
    require_runnable(DEVICE)
    rng = np.random.default_rng()  # fresh inputs every run; the seed only varies the sizes
    n, r = int(rng.integers(1, 3000)), [1, 2, 7, 200][seed]
    descs, regions = _random_case(rng, n, r)
    want_out, want_flags = reference_translate(descs, regions)
    out, flags, bad = _run(descs, regions, in_place=seed % 2 == 1)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(flags, want_flags)
    assert bad == int(want_flags.sum())
    assert 0 < bad < n or n < 20  # (both kinds occur)


@pytest.mark.parametrize("share", [0.0, 0.4, 1.0])
def test_a_count_on_the_device_translates_only_its_rows(share):
    """A launch queued behind a plan knows only the buffer's capacity: rows past the plan's count (read
    on the device) are stale and must be neither translated, flagged nor counted."""
    require_runnable(DEVICE)
    rng = np.random.default_rng()
    n = int(rng.integers(300, 3000))
    descs, regions = _random_case(rng, n, 7)
    rows = int(n * share)
    want_out, want_flags = reference_translate(descs[:rows], regions)
    out, flags, bad = _run(descs, regions, rows=rows)
    np.testing.assert_array_equal(out[:rows], want_out)
    np.testing.assert_array_equal(flags[:rows], want_flags)
    assert (out[rows:] == -7).all() and (flags[rows:] == 9).all()  # untouched past the count
    assert bad == int(want_flags.sum())


def test_golden_vectors():
    require_runnable(DEVICE)
    regions = np.array([[1000, 2000, 50_000], [3000, 3100, 90_000]])
    descs = np.array([
        [7, 1000, 1000],   # the whole first region
        [7, 1999, 2],      # straddles its end
        [7, 2500, 8],      # between the two
        [7, 3050, 50],     # the end of the second
        [7, 999, 1],       # below both
        [7, 3000, -1],     # a negative size
        [7, 3100, 0],      # empty, at the second's end: inside, nothing to write
    ])
    out, flags, bad = _run(descs, regions)
    assert out.tolist() == [[7, 50_000, 1000], [7, 1999, 0], [7, 2500, 0], [7, 90_050, 50], [7, 999, 0],
                            [7, 3000, 0], [7, 90_100, 0]]
    assert flags.tolist() == [0, 1, 1, 0, 1, 1, 0] and bad == 4
