"""Slot maps of vLLM's sliding-window KV cache groups, for kvplan's SWA components.

A request holds a block list per KV cache group. kvplan plans from one token table, the full-attention
group's (:mod:`.worker`); a sliding-window group's blocks are reached through its map, as SGLang's
``full_to_swa`` (planning.md §6), token by token: for each token ``t`` of the request's window,
``map[full_slot(t)] = window_slot(t)``, each slot counted in its own group's blocks (``block * block_size
+ t % block_size``), so a group may use blocks of another size than the full group's (vLLM gives layers of
smaller pages larger or padded blocks). vLLM frees a finished request's blocks before its window and hands
the connector its null block (0) there; a window block it freed all the same maps to 0, which the planner
refuses as an unmapped slot, naming the request: never the bytes of another request.

A map is shared by the requests in flight, so a full slot must map to one window slot at a time: a
request whose window disagrees with another's on full slots they share is refused
(:meth:`WindowMaps.claim`), and a request's claims end with it (:meth:`WindowMaps.release`). Claims are kept
by unit, the tokens both block sizes hold in a row (their gcd: a block where the sizes are equal).

Example::

    maps = WindowMaps(windows=(128,), num_blocks=4096, block_size=16, device=torch.device("cuda"))
    why = maps.claim("req-1", full_blocks, (swa_blocks,), prefix=0, num_tokens=300)
    maps.flush()                                   # one write per group, before the step's plan
"""

from __future__ import annotations

from math import gcd
from typing import Sequence

import numpy as np
import torch

__all__ = ["WindowMaps"]


class WindowMaps:
    """The slot maps of one side's sliding-window groups (``windows``: each group's window in tokens;
    ``block_sizes``: each group's block size, by default the full group's ``block_size``)."""

    def __init__(self, windows: Sequence[int], num_blocks: int, block_size: int, device: torch.device,
                 block_sizes: Sequence[int] = ()):
        self.windows, self.block_size = tuple(int(w) for w in windows), int(block_size)
        self.block_sizes = tuple(int(b) for b in block_sizes) or (self.block_size,) * len(self.windows)
        if len(self.block_sizes) != len(self.windows) or min(self.block_sizes, default=1) < 1:
            raise ValueError(f"{len(self.windows)} sliding-window groups, block sizes {self.block_sizes}")
        self.units = tuple(gcd(self.block_size, b) for b in self.block_sizes)  # tokens per claim, by group
        self.maps = [torch.zeros(num_blocks * block_size, dtype=torch.int64, device=device) for _ in self.windows]
        self._owners: list[dict[int, tuple[int, str]]] = [{} for _ in self.windows]  # full unit -> (its unit, who)
        self._claims: dict[str, list[tuple[int, int]]] = {}  # request -> (group, full unit) it claimed
        self._pending: list[list[tuple[str, int, int]]] = [[] for _ in self.windows]  # (who, full, own unit)

    def claim(self, request: str, full_blocks: Sequence[int], group_blocks: Sequence[Sequence[int]], prefix: int,
              num_tokens: int) -> str | None:
        """Map the window of a request whose blocks cover tokens ``[prefix, prefix + num_tokens)`` from the
        block of token ``prefix`` on (``full_blocks`` and each group's list, each in its own blocks):
        ``None``, or why it cannot be (nothing is claimed then)."""
        if len(group_blocks) != len(self.windows):
            return f"{len(group_blocks)} sliding-window block lists for {len(self.windows)} sliding-window groups"
        seq, fbs = prefix + num_tokens, self.block_size
        claims = []
        for g, (window, blocks, bs, unit) in enumerate(zip(self.windows, group_blocks, self.block_sizes, self.units)):
            if bs == fbs and len(blocks) != len(full_blocks):
                return (f"sliding-window group {g} has {len(blocks)} blocks where the full-attention group has "
                        f"{len(full_blocks)}")
            if prefix % bs:
                return f"a prefix of {prefix} tokens is not whole blocks of {bs} of sliding-window group {g}"
            covered = min(prefix + len(full_blocks) * fbs, (prefix // bs + len(blocks)) * bs)
            if covered < seq:
                return (f"sliding-window group {g} has {len(blocks)} blocks of {bs} tokens after a prefix of {prefix}, "
                        f"where the request holds {num_tokens} tokens")
            # (the window's first block, as the planner starts its list: planning.md §6)
            first = max(prefix, seq - (window - 1)) // bs * bs
            tokens = np.arange(first, covered, unit, dtype=np.int64)
            if not len(tokens):
                continue
            full = np.asarray(full_blocks, dtype=np.int64)[(tokens - prefix) // fbs] * fbs + tokens % fbs
            own = np.asarray(blocks, dtype=np.int64)[(tokens - prefix // bs * bs) // bs]
            own = np.where(own > 0, own * bs + tokens % bs, -unit)  # (vLLM's null block: no slot, written 0)
            for full_unit, own_unit in zip((full // unit).tolist(), (own // unit).tolist()):
                held = self._owners[g].get(full_unit)
                if held is not None and held[0] != own_unit and held[1] != request:
                    return (f"its sliding-window group {g} maps the tokens of full block {full_unit * unit // fbs} "
                            f"at slot {full_unit * unit} to its block {max(own_unit, 0) * unit // bs}, where request "
                            f"{held[1]!r} in flight maps them to block {max(held[0], 0) * unit // bs}")
                claims.append((g, full_unit, own_unit))
        for g, full_unit, own_unit in claims:
            self._owners[g][full_unit] = (own_unit, request)
            self._pending[g].append((request, full_unit, own_unit))
        self._claims.setdefault(request, []).extend((g, full_unit) for g, full_unit, _ in claims)
        return None

    def flush(self) -> None:
        """Write what was claimed since the last flush: one copy to the device and one write per group."""
        for g, pending in enumerate(self._pending):
            if not pending:
                continue
            unit = self.units[g]
            pairs = np.array([(full, own) for _, full, own in pending], dtype=np.int64)
            tokens = np.arange(unit, dtype=np.int64)
            index = (pairs[:, :1] * unit + tokens).reshape(-1)
            value = np.where(pairs[:, 1:] >= 0, pairs[:, 1:] * unit + tokens, 0).reshape(-1)  # (null: 0)
            both = torch.from_numpy(np.concatenate([index, value])).to(self.maps[g].device)
            self.maps[g][both[: len(index)]] = both[len(index):]
            pending.clear()

    def release(self, request: str) -> None:
        """End a request's claims, written or not (its slots may map elsewhere for the next request)."""
        for g, full in self._claims.pop(request, ()):
            if self._owners[g].get(full, (0, None))[1] == request:
                del self._owners[g][full]
        for pending in self._pending:
            pending[:] = [p for p in pending if p[0] != request]
