"""The maps by planning row of vLLM's Mamba KV cache groups, for kvplan's Mamba components.

A Mamba group holds a request's running state in one block (:meth:`~.groups.KVGroup.state_block` cuts
vLLM's list to it). kvplan's Mamba kind finds a request's slot through a map by planning row
(planning.md §6): ``map[row] = block``. A row belongs to one request while it is in flight, so rows
never collide; vLLM's null block (0) is refused, naming the request, rather than moved.

Example::

    slots = StateSlots(groups=1, rows=257, device=torch.device("cuda"))
    why = slots.put(row=3, group_blocks=([812],))      # None, or why not (nothing is kept then)
    slots.flush()                                      # one write per group, before the step's plan
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

__all__ = ["StateSlots"]


class StateSlots:
    """The row maps of one side's Mamba groups (``groups`` of them, ``rows`` planning rows each)."""

    def __init__(self, groups: int, rows: int, device: torch.device):
        self.maps = [torch.zeros(rows, dtype=torch.int64, device=device) for _ in range(groups)]
        self._pending: list[tuple[int, tuple[int, ...]]] = []  # (row, each group's block) not yet written

    def put(self, row: int, group_blocks: Sequence[Sequence[int]]) -> str | None:
        """Keep, for planning row ``row``, each Mamba group's state block (``group_blocks``: one list per
        group, cut to its state block): ``None``, or why it cannot be (nothing is kept then)."""
        if len(group_blocks) != len(self.maps):
            return f"{len(group_blocks)} Mamba block lists for {len(self.maps)} Mamba groups"
        blocks = []
        for g, listed in enumerate(group_blocks):
            if len(listed) != 1 or int(listed[0]) <= 0:
                return f"its Mamba group {g} holds no state block ({list(listed)[:4]})"
            blocks.append(int(listed[0]))
        if self.maps:
            self._pending.append((int(row), tuple(blocks)))
        return None

    def flush(self) -> None:
        """Write what was kept since the last flush: one copy to the device and one write per group."""
        if not self._pending:
            return
        table = np.array([(row, *blocks) for row, blocks in self._pending], dtype=np.int64)
        self._pending.clear()
        both = torch.from_numpy(table.T.copy()).to(self.maps[0].device)
        for g, slot_map in enumerate(self.maps):
            slot_map[both[0]] = both[1 + g]
