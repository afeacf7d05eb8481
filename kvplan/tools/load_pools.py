"""One ``kvplan load`` process's KV pools: pages and rows taken from free lists and given back, a
known byte per token, layer and request written by the stand-in forward pass, and every byte of a
completed request checked.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from ..planner.contract.batch import Attention, Entry, KVLayout, SideMemory
from .load_config import Arrival, LoadConfig

__all__ = ["Pools"]


def _pattern(arrival: Arrival, entry: int, tokens: torch.Tensor) -> torch.Tensor:
    """The byte every position of a token's item holds: per request, entry and token, never 0."""
    return ((arrival.index * 131 + entry * 17 + tokens) % 251 + 1).to(torch.uint8)


class Pools:
    """One side's pools for ``rows`` requests of ``prompt_max`` tokens: K and V per layer (``[pages,
    page_size, token_bytes]``), one aux entry of a row per request, the token table, and free lists
    of pages and rows (page 0 and row 0 are never handed out)."""

    def __init__(self, config: LoadConfig, device: str, rows: int):
        self.config, self.device = config, device
        ps, tb = config.page_size, config.token_bytes
        pages = rows * math.ceil(config.prompt_max / ps) + 1
        # every K and V entry in one tensor, so that a turn's stand-in writes and checks are one indexed op each
        self.kv_all = torch.zeros(2 * config.layers, pages, ps, tb, dtype=torch.uint8, device=device)
        self.kv = list(self.kv_all.unbind(0))
        self.aux = torch.zeros(rows + 1, 64, dtype=torch.uint8, device=device)
        self.table = torch.zeros(rows + 1, config.prompt_max + 1, dtype=torch.int32, device=device)
        entries = tuple(Entry(t.data_ptr(), ps * tb, pages) for t in self.kv)
        self.side = SideMemory(KVLayout(Attention.MHA, ps, entries, num_kv_heads=1),
                               aux=(Entry(self.aux.data_ptr(), 64, rows + 1),), req_to_token=self.table)
        self.free_pages = deque(range(1, pages))
        self.free_rows = deque(range(1, rows + 1))

    def take(self, length: int) -> tuple[int, list[int]] | None:
        """A row and the pages for ``length`` tokens, written into the token table; None when full."""
        need = math.ceil(length / self.config.page_size)
        if not self.free_rows or len(self.free_pages) < need:
            return None
        row, pages = self.free_rows.popleft(), [self.free_pages.popleft() for _ in range(need)]
        ps = self.config.page_size
        slots = (torch.tensor(pages, dtype=torch.int64)[:, None] * ps + torch.arange(ps)).reshape(-1)[:length]
        self.table[row].zero_()
        self.table[row, :length] = slots.to(torch.int32).to(self.device)
        return row, pages

    def give(self, row: int, pages: list[int]) -> None:
        self.free_rows.append(row)
        self.free_pages.extend(pages)

    def _slots(self, spans: list[tuple[Arrival, int, int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For ``(arrival, row, lo, hi)`` spans: each token's slot and token index, and which span it is of."""
        rows = torch.tensor([row for _, row, _, _ in spans], dtype=torch.int64)
        lens = torch.tensor([hi - lo for _, _, lo, hi in spans], dtype=torch.int64)
        span_of = torch.repeat_interleave(torch.arange(len(spans)), lens)
        starts = torch.tensor([lo for _, _, lo, _ in spans], dtype=torch.int64)
        tokens = starts[span_of] + torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        tokens, span_of, rows = tokens.to(self.device), span_of.to(self.device), rows.to(self.device)
        slots = self.table[rows[span_of], tokens].to(torch.int64)
        return slots, tokens, span_of

    def _expected(self, spans, tokens: torch.Tensor, span_of: torch.Tensor) -> torch.Tensor:
        """``[entries, tokens]``: the byte each token's item holds in each entry (as :func:`_pattern`)."""
        index = torch.tensor([a.index for a, *_ in spans], dtype=torch.int64, device=self.device)[span_of]
        entry = torch.arange(self.kv_all.shape[0], device=self.device)[:, None]
        return ((index[None] * 131 + entry * 17 + tokens[None]) % 251 + 1).to(torch.uint8)

    def write_many(self, spans: list[tuple[Arrival, int, int, int]]) -> None:
        """The stand-in forward pass for a turn: tokens ``[lo, hi)`` of each span, every entry, one write."""
        if not spans:
            return
        ps = self.config.page_size
        slots, tokens, span_of = self._slots(spans)
        self.kv_all[:, slots // ps, slots % ps] = self._expected(spans, tokens, span_of)[..., None]

    def write(self, arrival: Arrival, row: int, lo: int, hi: int) -> None:
        """The stand-in forward pass for tokens ``[lo, hi)`` of one request, in every KV entry."""
        self.write_many([(arrival, row, lo, hi)])

    def check_many(self, done: list[tuple[Arrival, int]]) -> list[bool]:
        """Whether every sent byte of each ``(arrival, row)`` is the one its source wrote, compared on the
        device in one pass over all of them (tokens past the prefix, and the aux row); one copy to the host."""
        if not done:
            return []
        ps = self.config.page_size
        spans = [(a, row, a.prefix_len, a.prompt_len) for a, row in done]
        slots, tokens, span_of = self._slots(spans)
        landed = self.kv_all[:, slots // ps, slots % ps]  # [entries, tokens, token_bytes]
        good = (landed == self._expected(spans, tokens, span_of)[..., None]).all(-1).all(0)
        bad = torch.zeros(len(done), dtype=torch.int64, device=self.device).index_add_(0, span_of, (~good).long())
        rows = torch.tensor([row for _, row in done], dtype=torch.int64, device=self.device)
        aux = torch.tensor([a.index % 251 + 1 for a, _ in done], dtype=torch.uint8, device=self.device)
        aux_good = (self.aux[rows] == aux[:, None]).all(-1)
        return ((bad == 0) & aux_good).tolist()

    def check(self, arrival: Arrival, row: int) -> bool:
        """Whether every sent byte of the request is the one its source wrote (tokens past the prefix,
        and the aux row)."""
        ps = self.config.page_size
        tokens = torch.arange(arrival.prefix_len, arrival.prompt_len, device=self.device)
        slots = self.table[row, arrival.prefix_len : arrival.prompt_len].to(torch.int64)
        for e, pool in enumerate(self.kv):
            if not bool((pool[slots // ps, slots % ps] == _pattern(arrival, e, tokens)[:, None]).all()):
                return False
        return bool((self.aux[row] == arrival.index % 251 + 1).all())
