"""Host memory images and a NumPy descriptor executor, for checking what a transfer wrote.

An :class:`AddressSpace` holds byte arrays behind addresses: made-up ones (planning without
memory, in tests) or the addresses of real tensors (copies of their bytes). :func:`execute` runs
descriptors on such images, one descriptor after another; it is slow and obviously right, which
is what a verification wants.

Example::

    expected = AddressSpace.of_tensors(dst_tensors, zero=True)
    execute(plan.descriptors()[0], AddressSpace.of_tensors(src_tensors), expected)
    assert expected.matches(dst_tensors)
"""

from __future__ import annotations

import numpy as np

from ..planner.contract.batch import Entry, SideMemory


class AddressSpace:
    """Byte arrays behind entries' (made-up) addresses; descriptors are executed against them."""

    def __init__(self, entries: list[Entry], rng: np.random.Generator | None = None):
        uniq = {e.base_ptr: e for e in entries}
        self.bases = np.array(sorted(uniq), dtype=np.uint64)
        self.arrays = []
        for b in self.bases:
            e = uniq[int(b)]
            size = e.item_len * e.num_items
            data = rng.integers(0, 256, size, dtype=np.uint8) if rng is not None else np.zeros(size, np.uint8)
            self.arrays.append(data)

    @classmethod
    def of_tensors(cls, tensors, zero: bool = False) -> "AddressSpace":
        """Host copies (or zeros) of real tensors, addressed by the tensors' own pointers."""
        space = cls([])
        order = sorted(range(len(tensors)), key=lambda i: tensors[i].data_ptr())
        space.bases = np.array([tensors[i].data_ptr() for i in order], dtype=np.uint64)
        space.arrays = [np.zeros(tensors[i].numel(), np.uint8) if zero else tensors[i].cpu().numpy().copy()
                        for i in order]
        return space

    def matches(self, tensors) -> bool:
        """Whether every tensor holds exactly this space's bytes at its address."""
        by_base = dict(zip(self.bases.tolist(), self.arrays))
        return all(np.array_equal(by_base[t.data_ptr()], t.cpu().numpy()) for t in tensors)

    @classmethod
    def of_side(cls, side: SideMemory, rng: np.random.Generator | None = None) -> "AddressSpace":
        entries = list(side.kv.entries) + [e for c in side.state for e in c.entries] + list(side.aux)
        return cls(entries, rng)

    def locate(self, addr: int, nbytes: int) -> tuple[np.ndarray, int]:
        i = int(np.searchsorted(self.bases, np.uint64(addr), side="right")) - 1
        assert i >= 0, f"address {addr:#x} is below every region"
        off = int(addr) - int(self.bases[i])
        arr = self.arrays[i]
        assert off + nbytes <= arr.size, f"[{addr:#x}, +{nbytes}) runs past its region"
        return arr, off

    def entry_bytes(self, entry: Entry, item: int) -> np.ndarray:
        arr, off = self.locate(entry.base_ptr + item * entry.item_len, entry.item_len)
        return arr[off : off + entry.item_len]


__all__ = ["AddressSpace", "execute"]


def execute(descs: np.ndarray, src: AddressSpace, dst: AddressSpace, coverage: AddressSpace | None = None) -> None:
    """Copy every descriptor's bytes from ``src`` to ``dst``; count written bytes in ``coverage``."""
    for s, d, n in descs.tolist():
        sa, so = src.locate(s, n)
        da, do = dst.locate(d, n)
        da[do : do + n] = sa[so : so + n]
        if coverage is not None:
            ca, co = coverage.locate(d, n)
            ca[co : co + n] += 1
