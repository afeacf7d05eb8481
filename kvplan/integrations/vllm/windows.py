"""Slot maps of vLLM's sliding-window KV cache groups, for kvplan's SWA components.

A request holds a block list per KV cache group. kvplan plans from one token table, the full-attention
group's (:mod:`.worker`); a sliding-window group's blocks are reached through its map, as SGLang's
``full_to_swa`` (planning.md §6): ``map[full_block * block_size + t] = window_block * block_size + t``
for the blocks of the request's window, block for block by position. vLLM frees a finished request's
blocks before its window and hands the connector its null block (0) there; a window block it freed all
the same maps to 0, which the planner refuses as an unmapped slot, naming the request: never the bytes
of another request.

A map is shared by the requests in flight, so a full block must map to one window block at a time: a
request whose window blocks disagree with another's on a full block they share is refused
(:meth:`WindowMaps.claim`), and a request's claims end with it (:meth:`WindowMaps.release`).

Example::

    maps = WindowMaps(windows=(128,), num_blocks=4096, block_size=16, device=torch.device("cuda"))
    why = maps.claim("req-1", full_blocks, (swa_blocks,), prefix=0, num_tokens=300)
    maps.flush()                                   # one write per group, before the step's plan
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

__all__ = ["WindowMaps"]


class WindowMaps:
    """The slot maps of one side's sliding-window groups (``windows``: each group's window in tokens)."""

    def __init__(self, windows: Sequence[int], num_blocks: int, block_size: int, device: torch.device):
        self.windows, self.block_size = tuple(int(w) for w in windows), int(block_size)
        self.maps = [torch.zeros(num_blocks * block_size, dtype=torch.int64, device=device) for _ in self.windows]
        self._owners: list[dict[int, tuple[int, str]]] = [{} for _ in self.windows]  # full block -> (its block, who)
        self._claims: dict[str, list[tuple[int, int]]] = {}  # request -> (group, full block) it claimed
        self._pending: list[list[tuple[str, int, int]]] = [[] for _ in self.windows]  # (who, full, window block)

    def claim(self, request: str, full_blocks: Sequence[int], group_blocks: Sequence[Sequence[int]], prefix: int,
              num_tokens: int) -> str | None:
        """Map the window blocks of a request whose blocks cover tokens ``[prefix, prefix + num_tokens)``
        (``full_blocks`` and each group's list, block for block): ``None``, or why it cannot be (nothing is
        claimed then)."""
        if len(group_blocks) != len(self.windows):
            return f"{len(group_blocks)} sliding-window block lists for {len(self.windows)} sliding-window groups"
        seq, bs = prefix + num_tokens, self.block_size
        claims = []
        for g, (window, blocks) in enumerate(zip(self.windows, group_blocks)):
            if len(blocks) != len(full_blocks):
                return (f"sliding-window group {g} has {len(blocks)} blocks where the full-attention group has "
                        f"{len(full_blocks)}")
            first = max(prefix, seq - (window - 1)) // bs - prefix // bs  # (the list's window, planning.md §6)
            for full, own in zip(full_blocks[max(0, first):], blocks[max(0, first):]):
                held = self._owners[g].get(int(full))
                if held is not None and held[0] != int(own) and held[1] != request:
                    return (f"its sliding-window group {g} maps full block {full} to block {own}, where request "
                            f"{held[1]!r} in flight maps it to {held[0]}")
                claims.append((g, int(full), int(own)))
        for g, full, own in claims:
            self._owners[g][full] = (own, request)
            self._pending[g].append((request, full, own))
        self._claims.setdefault(request, []).extend((g, full) for g, full, _ in claims)
        return None

    def flush(self) -> None:
        """Write what was claimed since the last flush: one copy to the device and one write per group."""
        for g, pending in enumerate(self._pending):
            if not pending:
                continue
            pairs = np.array([(full, own) for _, full, own in pending], dtype=np.int64)
            tokens = np.arange(self.block_size, dtype=np.int64)
            index = (pairs[:, :1] * self.block_size + tokens).reshape(-1)
            value = np.where(pairs[:, 1:] > 0, pairs[:, 1:] * self.block_size + tokens, 0).reshape(-1)  # (null: 0)
            both = torch.from_numpy(np.concatenate([index, value])).to(self.maps[g].device)
            self.maps[g][both[: len(index)]] = both[len(index):]
            pending.clear()

    def release(self, request: str) -> None:
        """End a request's claims, written or not (its blocks may map elsewhere for the next request)."""
        for g, full in self._claims.pop(request, ()):
            if self._owners[g].get(full, (0, None))[1] == request:
                del self._owners[g][full]
        for pending in self._pending:
            pending[:] = [p for p in pending if p[0] != request]
