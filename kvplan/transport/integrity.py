"""Opt-in integrity: per-request checksums of the bytes sent, compared when the request has landed
(docs/failures.md §7).

A decode endpoint made with ``integrity=True`` asks its senders for checksums when it registers.
A sender then sums, on the device right behind each plan, the source bytes of every descriptor
keyed by where they land (:mod:`kvplan.kernels.checksum`), adds a request's chunks up, and once the
request's last chunk has been written sends the sum (``"checksum"``). The decode side sums the
bytes of what it published for the request, over its own addresses, when every section has
landed: a request is complete only when the two agree, and fails with the reason when they do
not. A byte flipped by a NIC, a bounce buffer or a stray write then fails its request instead of
decoding from corrupted KV.

With a shared secret (the control channels', :mod:`.auth`) the checksum is keyed, per request
(:func:`~kvplan.transport.auth.checksum_key`): bytes that anyone without the secret wrote fail their
request, however they were chosen. Without one it is unkeyed, and guards against accidents only: its
hash is public, so a writer can pick changes that leave it as it was.

What it covers: layouts where the sender's bytes fill the decode's items whole (equal page sizes,
strict lists, TP scatter; a TP gather adds its senders' sums), through direct and staged writes.
Not covered, and refused: NIXL prepared lists (no descriptors to sum), layer-wise streaming (the
bytes are not all written when the batch is planned), and sides of different page sizes (the
decode's items are written in part).

Example::

    decode = DecodeEndpoint(side, engine, channel, integrity=True)   # the sender follows its registration
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..kernels.checksum import MASK, checksum_descriptors

__all__ = ["MASK", "RunningSums", "key_table", "published_sums", "transfer_sums"]

Key = tuple[int, int] | None  # a slot's checksum key (auth.checksum_key), or None: unkeyed


def key_table(keys: list[Key] | None, device: torch.device | str) -> torch.Tensor | None:
    """The kernel's ``[m, 3]`` key table for one key (or ``None``) per slot; ``None`` when none is keyed
    (the launch without a table)."""
    if keys is None or all(k is None for k in keys):
        return None
    rows = np.array([[k[0], k[1], 1] if k is not None else [0, 0, 0] for k in keys], dtype=np.int64)
    return torch.from_numpy(rows).to(device, non_blocking=True)


def transfer_sums(device_descs: torch.Tensor, per_transfer: np.ndarray, nbytes: int = 0,
                  keys: list[Key] | None = None) -> torch.Tensor:
    """Each transfer's checksum (int64 ``[T]`` on the descriptors' device, mod 2**32 once read), from
    a plan's descriptors ``(src, dst, nbytes)`` and its per-transfer offsets ``[T + 1]``; launched on
    the current stream, behind the plan. ``nbytes``: the plan's bytes, which shape the launch;
    ``keys``: each transfer's key (its request's), or none."""
    counts = torch.from_numpy(np.diff(np.asarray(per_transfer, np.int64)))
    owners = torch.repeat_interleave(torch.arange(len(counts)), counts).to(device_descs.device, non_blocking=True)
    out = torch.zeros(len(counts), dtype=torch.int64, device=device_descs.device)
    n = int(per_transfer[-1])
    checksum_descriptors(device_descs[:n], owners, out, typical_bytes=max(1, nbytes // max(1, n)) if nbytes else 4096,
                         keys=key_table(keys, device_descs.device))
    return out


def published_sums(ranges: list[tuple[np.ndarray, np.ndarray]], device: torch.device | str,
                   keys: list[Key] | None = None) -> list[int]:
    """The checksum of the bytes in each ``(starts, ends)`` set of ranges on ``device`` (the decode's own
    published ranges, one set per request, under its key in ``keys`` or unkeyed): one launch for all of
    them, read back at once."""
    if not ranges:
        return []
    starts = np.concatenate([np.asarray(a, np.uint64) for a, _ in ranges])
    ends = np.concatenate([np.asarray(b, np.uint64) for _, b in ranges])
    owners = np.repeat(np.arange(len(ranges), dtype=np.int64), [len(a) for a, _ in ranges])
    rows = np.stack([starts, starts, ends - starts], axis=1).view(np.int64)
    descs = torch.from_numpy(np.ascontiguousarray(rows)).to(device)
    out = torch.zeros(len(ranges), dtype=torch.int64, device=device)
    typical = int((ends - starts).mean()) if len(starts) else 1
    checksum_descriptors(descs, torch.from_numpy(owners).to(device), out, typical_bytes=typical,
                         keys=key_table(keys, device))
    return [int(x) & MASK for x in out.cpu()]


class RunningSums:
    """Each ``(peer, request)``'s checksum so far, on the device: a chunk's sum is added there without
    the host waiting, and a request's is read once, when its last chunk has gone (one wait for every
    request that finished in the send, none for a send of middle chunks)."""

    def __init__(self) -> None:
        self._slots: dict[Any, int] = {}
        self._free: list[int] = []
        self._acc: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self._slots)

    def _slot(self, key: Any, device: torch.device) -> int:
        if key not in self._slots:
            if not self._free:
                old = 0 if self._acc is None else self._acc.numel()
                grown = torch.zeros(max(64, 2 * old), dtype=torch.int64, device=device)
                if self._acc is not None:
                    grown[:old] = self._acc
                self._free = list(range(grown.numel() - 1, old - 1, -1))
                self._acc = grown
            self._slots[key] = self._free.pop()
        return self._slots[key]

    def add(self, keys: list, sums: torch.Tensor) -> None:
        """Add ``sums[i]`` (device int64) to ``keys[i]``'s running sum."""
        if keys:
            slots = [self._slot(key, sums.device) for key in keys]
            self._acc.index_add_(0, torch.tensor(slots, device=sums.device), sums)

    def take(self, keys: list) -> list[int]:
        """The running sums of ``keys`` (mod 2**32), read at once, and forgotten."""
        if not keys:
            return []
        slots = [self._slots.pop(key) for key in keys]
        index = torch.tensor(slots, device=self._acc.device)
        values = [int(x) & MASK for x in self._acc[index].cpu()]
        self._acc[index] = 0
        self._free += slots
        return values

    def drop(self, keys: list) -> None:
        """Forget ``keys``' sums (their requests failed or were forgotten)."""
        slots = [self._slots.pop(key) for key in keys if key in self._slots]
        if slots:
            self._acc[torch.tensor(slots, device=self._acc.device)] = 0
            self._free += slots

    def keys(self) -> list:
        return list(self._slots)
