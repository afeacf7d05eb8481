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

__all__ = ["Checked", "Pools"]


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
        self._queued_rows: dict[int, tuple[list[int], int]] = {}  # taken, not yet in the table: pages, length

    def take(self, length: int) -> tuple[int, list[int]] | None:
        """A row and the pages for ``length`` tokens; None when full. The row's token-table entries reach the
        device at the next :meth:`flush` (every method here that reads the table flushes first)."""
        need = math.ceil(length / self.config.page_size)
        if not self.free_rows or len(self.free_pages) < need:
            return None
        row, pages = self.free_rows.popleft(), [self.free_pages.popleft() for _ in range(need)]
        self._queued_rows[row] = (pages, length)
        return row, pages

    def flush(self) -> None:
        """Write every row taken since the last flush into the token table: one copy to the device, queued on
        the current stream without waiting for it (a copy that waits would wait for the card's other work,
        which on a card shared by several processes is their time too)."""
        if not self._queued_rows:
            return
        ps, width = self.config.page_size, self.table.shape[1]
        rows = torch.tensor(list(self._queued_rows), dtype=torch.int64)
        values = torch.zeros(len(rows), width, dtype=torch.int32)
        for k, (pages, length) in enumerate(self._queued_rows.values()):
            slots = (torch.tensor(pages, dtype=torch.int64)[:, None] * ps + torch.arange(ps)).reshape(-1)[:length]
            values[k, :length] = slots.to(torch.int32)
        self._queued_rows.clear()
        self.table.index_copy_(0, self._upload(rows), self._upload(values))

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on this side's device, copied in the current stream's order without waiting (through pinned
        memory, which torch's host allocator keeps until the copy has read it)."""
        if self.table.device.type != "cuda":
            return host
        return host.pin_memory().to(self.table.device, non_blocking=True)

    def give(self, row: int, pages: list[int]) -> None:
        self.free_rows.append(row)
        self.free_pages.extend(pages)

    def _slots(self, spans: list[tuple[Arrival, int, int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For ``(arrival, row, lo, hi)`` spans: each token's slot and token index, and which span it is of."""
        self.flush()
        rows = torch.tensor([row for _, row, _, _ in spans], dtype=torch.int64)
        lens = torch.tensor([hi - lo for _, _, lo, hi in spans], dtype=torch.int64)
        span_of = torch.repeat_interleave(torch.arange(len(spans)), lens)
        starts = torch.tensor([lo for _, _, lo, _ in spans], dtype=torch.int64)
        tokens = starts[span_of] + torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        tokens, span_of, rows = self._upload(tokens), self._upload(span_of), self._upload(rows)
        slots = self.table[rows[span_of], tokens].to(torch.int64)
        return slots, tokens, span_of

    def _expected(self, spans, tokens: torch.Tensor, span_of: torch.Tensor) -> torch.Tensor:
        """``[entries, tokens]``: the byte each token's item holds in each entry (as :func:`_pattern`)."""
        index = self._upload(torch.tensor([a.index for a, *_ in spans], dtype=torch.int64))[span_of]
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

    def check_later(self, done: list[tuple[Arrival, int]], again: list[tuple[Arrival, int]] = ()) -> "Checked":
        """Whether every sent byte of each ``(arrival, row)`` of ``done`` is the one its source wrote, compared
        on the device in one pass over all of them (tokens past the prefix, and the aux row); and of each of
        ``again``, the same compared another way (:meth:`check`'s, entry by entry). Nothing waits: the
        answers come back to the host in the current stream's order (:class:`Checked`)."""
        self.flush()
        if not done:
            ok = torch.zeros(0, dtype=torch.bool, device=self.device)
        else:
            ps = self.config.page_size
            spans = [(a, row, a.prefix_len, a.prompt_len) for a, row in done]
            slots, tokens, span_of = self._slots(spans)
            landed = self.kv_all[:, slots // ps, slots % ps]  # [entries, tokens, token_bytes]
            good = (landed == self._expected(spans, tokens, span_of)[..., None]).all(-1).all(0)
            bad = torch.zeros(len(done), dtype=torch.int64, device=self.device).index_add_(0, span_of, (~good).long())
            rows = self._upload(torch.tensor([row for _, row in done], dtype=torch.int64))
            aux = self._upload(torch.tensor([a.index % 251 + 1 for a, _ in done], dtype=torch.uint8))
            ok = (bad == 0) & (self.aux[rows] == aux[:, None]).all(-1)
        return Checked(torch.cat([ok, *(self._check_one(a, row)[None] for a, row in again)]), len(done))

    def check_many(self, done: list[tuple[Arrival, int]]) -> list[bool]:
        """:meth:`check_later`'s answers for ``done``, waited for."""
        return self.check_later(done).results()[0]

    def _check_one(self, arrival: Arrival, row: int) -> torch.Tensor:
        """On the device, whether every sent byte of one request is the one its source wrote: entry by entry
        from the token table, a path that shares nothing with :meth:`check_later`'s but the table."""
        self.flush()
        ps = self.config.page_size
        tokens = torch.arange(arrival.prefix_len, arrival.prompt_len, device=self.device)
        slots = self.table[row, arrival.prefix_len : arrival.prompt_len].to(torch.int64)
        each = [(pool[slots // ps, slots % ps] == _pattern(arrival, e, tokens)[:, None]).all() for e, pool in enumerate(self.kv)]
        return torch.stack([*each, (self.aux[row] == arrival.index % 251 + 1).all()]).all()

    def check(self, arrival: Arrival, row: int) -> bool:
        """Whether every sent byte of the request is the one its source wrote (tokens past the prefix, and
        the aux row), compared entry by entry; waited for."""
        return bool(self._check_one(arrival, row))


class Checked:
    """Checks on their way to the host: :meth:`ready` once they have arrived (a look, never a wait), then
    :meth:`results`."""

    def __init__(self, answers: torch.Tensor, first: int):
        self._first, self._event = first, None
        if answers.device.type == "cuda":
            self._host = torch.empty(answers.shape, dtype=answers.dtype, pin_memory=True)
            self._host.copy_(answers, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = answers

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def results(self) -> tuple[list[bool], list[bool]]:
        """The answers for ``done`` and for ``again`` (waits for them if not :meth:`ready`)."""
        if self._event is not None:
            self._event.synchronize()
        values = self._host.tolist()
        return values[: self._first], values[self._first :]
