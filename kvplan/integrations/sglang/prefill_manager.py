"""The prefill half of kvplan's SGLang manager (:class:`PrefillManager`, a part of
:class:`~kvplan.integrations.sglang.adapter.KVManager`): a scheduler step's sends taken in, planned as one
batch with each request's rows and state lists checked against what its decode published, submitted to
the prefill endpoint's progress thread, and settled as they end.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode

from ...errors import InputError, KvplanError, LayoutError
from ...planner.contract.block_tables import token_table_from_blocks
from ...planner.contract.state_kinds import rules_of
from ...transport.prefill import Chunk
from .inputs import ids as host_ids_of, state_lists_of

__all__ = ["PrefillManager"]

log = logging.getLogger(__name__)

# batches a prefill manager keeps moving at once (below its endpoint's max_in_flight, which would refuse more
# with "overload"): sends handed over while both move wait for the next flush and go together, one larger batch
MOVING_MAX = 2

# (the adapter's KVSender, whose sends are queued here: typed as Any, the adapter imports this module)
Sender = Any


class PrefillManager:
    """The prefill role of :class:`~kvplan.integrations.sglang.adapter.KVManager` (its state lives on the manager)."""

    def has_lists(self, room: int) -> bool:
        """Whether ``room`` may go: every decode rank it is spread over here has published its lists (a
        decode of a larger attention TP publishes each room from several ranks this one serves)."""
        return (bool(self._peers_of(room)) and self.prefill.published_by_all(room)) or self._dummy(room)

    def _dummy(self, room: int) -> bool:
        """Whether only SGLang's dummy decode ranks asked for ``room``: nothing of it goes from here."""
        return self.ranks is not None and room in self.ranks.dummies

    def _peers_of(self, room: int) -> list[int]:
        """The decode sides (peer indices) that published ``room``'s lists: one decode manager, or with
        SGLang's protocol each decode rank the decode's TP spreads the request over."""
        return [k for k, p in enumerate(self.prefill.peers) if room in p.lists]

    def enqueue(self, sender: Sender, pages: np.ndarray, state: tuple[np.ndarray, ...] | None,
                tokens: int) -> None:
        self._pending.append((sender, pages, state, tokens))
        self._handed = True  # (the next poll flushes it)

    def enqueue_copying(self, sender: Sender, host_ids: Any, event: Any, state: tuple[np.ndarray, ...] | None,
                        tokens: int) -> None:
        """A send whose page ids are still being copied off the GPU (``event`` marks the copy's end): it
        joins the pending step once the event has passed (:meth:`_take_copied`)."""
        self._copying.append((sender, host_ids, event, state, tokens))
        self._handed = True

    def _take_copied(self) -> None:
        """Move the sends whose ids have landed on the host into the pending step, in the order they came;
        a request's later chunks wait behind one still copying. Never waits: the events are only asked."""
        held, still = set(), []
        for sender, host_ids, event, state, tokens in self._copying:
            if sender.room in held or not event.query():
                held.add(sender.room)
                still.append((sender, host_ids, event, state, tokens))
            else:
                self._pending.append((sender, host_ids_of(host_ids), state, tokens))
        self._copying = still

    def flush(self) -> None:
        """Plan every ``send`` since the last flush as one kvplan batch and move it. A step that
        cannot be laid out fails every send of it, on both sides; nothing of it is sent."""
        if self._copying:
            self._take_copied()
        if len(self._moving) >= MOVING_MAX:
            self._take_completed()
            if len(self._moving) >= MOVING_MAX:
                return  # (what was handed over meanwhile goes together in the next batch)
        pending, self._pending = self._pending, []
        pending = [x for x in pending if self.status.get(x[0].room) != KVPoll.Failed]  # aborted or failed: unsent
        for sender, pages, _, _ in [x for x in pending if self._dummy(x[0].room)]:
            sender.pages_sent += len(pages)  # as SGLang's prefill does for a dummy: it succeeds unsent
            if sender.pages_sent >= sender.num_pages:
                self._settle(sender.room, KVPoll.Success)
        pending = [x for x in pending if not self._dummy(x[0].room)]
        if len(pending) < self.table.shape[0]:  # (a step too large for the table fails whole, in _chunks)
            for sender, *_ in [x for x in pending if not self._peers_of(x[0].room)]:  # its decode side went away
                self._settle(sender.room, KVPoll.Failed, "the decode side is gone: its lists were dropped")
            pending = [x for x in pending if self._peers_of(x[0].room)]
        if not pending:
            return
        try:
            chunks = self._chunks(pending)
        except KvplanError as err:
            reason = f"{type(err).__name__}: {err}"
            for sender, *_ in pending:
                self._settle(sender.room, KVPoll.Failed, reason)
            by_peer: dict[int, list[int]] = {}
            for sender, *_ in pending:
                for k in self._peers_of(sender.room):
                    if sender.room not in by_peer.get(k, []):
                        by_peer.setdefault(k, []).append(sender.room)
            for k, rooms in by_peer.items():
                self.prefill.fail(rooms, reason, peer=k)
            return
        if not chunks:
            return
        if self.aux_mirror is not None:  # (queued on the scheduler's stream, before the plan that reads them)
            self.aux_mirror.upload([t.aux_src for t in chunks if t.last])
        handle = self.prefill.submit(chunks, mode=self.transfer_mode, timeout=self.timeout)
        self._moving[handle] = (chunks, {t.src_row for t in chunks})
        self._take_completed()

    def _take_completed(self) -> None:
        """Settle the requests of every submitted batch that ended (never waits)."""
        for handle in self.prefill.completed():
            chunks, _ = self._moving.pop(handle, ([], set()))
            try:
                results = handle.result(timeout=0)
            except KvplanError as err:  # a batch that does not plan is refused whole
                results = {t.request: f"{type(err).__name__}: {err}" for t in chunks}
            self._settle_sent(chunks, results)

    def _settle_sent(self, chunks: list, results: dict) -> None:
        """Settle a batch's requests from its results (per request ``None`` or the reason)."""
        for request in dict.fromkeys(t.request for t in chunks):  # (a request's chunk may go to several ranks)
            reason = results.get(request)
            if reason is not None:
                self._settle(request, KVPoll.Failed, reason)
            elif any(t.last for t in chunks if t.request == request):
                self._settle(request, KVPoll.Success)
                self.prefill.forget([request])

    def _busy_rows(self) -> set[int]:
        """The planning rows that submitted batches still hold."""
        return set().union(*(rows for _, rows in self._moving.values())) if self._moving else set()

    def _chunks(self, pending: list[tuple[Sender, np.ndarray, tuple[np.ndarray, ...] | None, int]]) -> list:
        """The step's transfers, with their requests' pages written into the planning table and, for a
        last chunk, its state lists into the components' maps."""
        ps, endpoint = self.page_size, self.prefill
        if len(pending) >= self.table.shape[0]:
            raise LayoutError(f"{len(pending)} sends in one step; the planning table has "
                              f"{self.table.shape[0] - 1} rows (server arg max_running_requests)")
        # SGLang hands page ids: a block table (one row per send), expanded into token slots on the
        # planning device (kvplan.planner.contract.block_tables). A row holds every page of its request so far:
        # an SWA window reaches back into earlier chunks.
        rows = self._rows(pending)
        waiting = {x[0].room for x, row in zip(pending, rows) if row is None}
        if waiting:  # its row is held by a batch still moving (or none is free): it goes with a later flush
            self._pending = [x for x in pending if x[0].room in waiting] + self._pending
            kept = [(r, x) for r, x in zip(rows, pending) if x[0].room not in waiting]
            if not kept:
                return []
            rows, pending = (list(t) for t in zip(*kept))
        chunks, blocks = [], np.zeros((len(rows), self.table.shape[1] // ps), np.int32)
        by_row = np.zeros((len(self.maps), len(rows)), np.int64)
        by_slot: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in self.maps]
        for i, (row, (sender, pages, state, tokens)) in enumerate(zip(rows, pending)):
            peers = self._peers_of(sender.room)
            published = endpoint.peers[peers[0]].lists.get(sender.room) if peers else None
            if published is None:  # aborted on the progress thread a moment ago: nothing of it goes (read next poll)
                continue
            prefix = published[2]
            first = prefix // ps + sender.pages_sent
            if first + len(pages) > blocks.shape[1]:
                raise LayoutError(f"request {sender.room}: {(first + len(pages)) * ps} tokens exceed the planning "
                                  f"table's {self.table.shape[1]} (server arg context_length)")
            held = np.concatenate(sender.pages + [pages])
            if len(held) != sender.pages_sent + len(pages):  # never, unless an earlier step broke off midway
                raise InputError(sender.room, f"{len(held)} pages handed over so far, {sender.pages_sent + len(pages)} "
                                              "counted: its earlier chunks were not all laid out")
            sender.pages.append(pages)
            blocks[i, prefix // ps : first + len(pages)] = held
            sender.pages_sent += len(pages)
            last = sender.pages_sent >= sender.num_pages
            end = (first + len(pages)) * ps
            if last:  # the request's true length (SGLang's num_kv_tokens), inside its last page
                sender.tokens_sent += tokens
                end = prefix + sender.tokens_sent
                if not (first + len(pages) - 1) * ps < end <= (first + len(pages)) * ps:
                    raise InputError(sender.room, f"{sender.tokens_sent} tokens after a decode prefix of {prefix} do "
                                                  f"not end in its last page ({sender.num_pages} pages of {ps})")
                if self.maps:  # the components' lists come with the last chunk
                    self._state_inputs(sender.room, row, i, prefix, end, held, state, by_row, by_slot)
            else:
                sender.tokens_sent += len(pages) * ps
            prompt = end if last else prefix + sender.num_pages * ps
            chunk = Chunk(sender.room, row, first * ps, end, prompt, last, sender.aux_index)
            chunks += [endpoint.transfer(chunk, peer=k) for k in peers]
        # only this step's rows are written (rows of batches still moving are being planned from)
        at = torch.tensor(list(rows), dtype=torch.int64).to(self.device)
        tokens = token_table_from_blocks(torch.from_numpy(blocks).to(self.device), ps)
        self.table[at] = torch.nn.functional.pad(tokens, (0, self.table.shape[1] - tokens.shape[1]))
        for c, slot_map in enumerate(self.maps):
            if slot_map is not None and rules_of(self.prefill.side.state[c].kind).map_by_row:
                slot_map[at] = torch.from_numpy(by_row[c]).to(self.device)
            elif slot_map is not None and by_slot[c]:
                slots_at, values = (np.concatenate(x) for x in zip(*by_slot[c]))
                slot_map[torch.from_numpy(slots_at).to(self.device)] = torch.from_numpy(values).to(self.device)
        return chunks

    def _rows(self, pending: list[tuple[Sender, np.ndarray, tuple[np.ndarray, ...] | None, int]]) -> list[int | None]:
        """Each send's planning row: a last chunk with ring rows takes the row they are of (SGLang's
        request-pool row, ``ids[0] // R``: kvplan's ring formula reads the planning row); the other
        sends take the first free rows from 1. A row that a batch still moving holds is not free:
        a send that needs it (or finds none free) gets ``None`` and waits for a later flush."""
        comps = self.prefill.side.state
        rings = [c for c, comp in enumerate(comps) if rules_of(comp.kind).needs_ring]
        fixed: dict[int, int] = {}
        for k, (sender, pages, state, _) in enumerate(pending):
            last = sender.pages_sent + len(pages) >= sender.num_pages
            if not rings or not last or state is None or len(state) != len(comps) or not len(state[rings[0]]):
                continue  # a missing list is reported with the request's other state checks
            row = int(state[rings[0]][0]) // comps[rings[0]].ring_size
            if not 0 <= row < self.table.shape[0]:
                raise InputError(sender.room, f"its ring rows are of request-pool row {row}; the planning table has "
                                              f"{self.table.shape[0]} rows (server arg max_running_requests)")
            if row in fixed.values():
                raise InputError(sender.room, f"its ring rows are of request-pool row {row}, as another request's "
                                              "in this step")
            fixed[k] = row
        busy = self._busy_rows()
        free = (r for r in range(1, self.table.shape[0]) if r not in fixed.values() and r not in busy)
        return [(None if fixed[k] in busy else fixed[k]) if k in fixed else next(free, None) for k in range(len(pending))]

    def _state_inputs(self, room: int, row: int, i: int, prefix: int, end: int, held: np.ndarray,
                      state: tuple[np.ndarray, ...] | None, by_row: np.ndarray, by_slot: list) -> None:
        """Map a last chunk's state lists (one per component, as SGLang computed them) onto kvplan's
        planning inputs, or raise InputError naming the request (see the module docstring)."""
        comps, ps = self.prefill.side.state, self.page_size
        for c, ids in enumerate(state_lists_of(room, state, comps)):
            comp, rules = comps[c], rules_of(comps[c].kind)
            if rules.map_by_row:
                by_row[c, i] = int(ids[0])
            elif rules.needs_ring:  # kvplan's formula over the request's row (_rows placed it there)
                rows = row * comp.ring_size + np.arange(max(0, end - comp.window), end) % comp.ring_size
                if not np.array_equal(ids, rows):
                    raise InputError(room, f"state component {comp.name!r}: SGLang's ring rows {ids[:8].tolist()}... "
                                           f"are not the last {comp.window} positions' rows of request-pool row "
                                           f"{row} {rows[:8].tolist()}...")
            elif prefix and rules.paged and not comp.from_prefix:  # the planning row holds no prefix pages
                raise InputError(room, f"state component {comp.name!r}: with a decode prefix ({prefix} tokens) SGLang "
                                       f"starts its {comp.kind.value} list at the prefix; this component was declared "
                                       "with from_prefix=False (planning.md §6)")
            elif rules.needs_map:  # the window's last pages, translated: into the token slot map
                if len(ids) > len(held):
                    raise InputError(room, f"state component {comp.name!r}: {len(ids)} window pages for a request "
                                           f"of {len(held)} pages")
                start = rules.list_start(comp, comp.pages_of(ps), end, prefix)
                if len(ids) != -(-(end - start) // ps):  # else kvplan's window would read another request's map
                    raise InputError(room, f"state component {comp.name!r}: {len(ids)} window pages where a window of "
                                           f"{comp.window} tokens over {end} holds {-(-(end - start) // ps)} "
                                           "(kvplan_state_params gives the window)")
                lane = np.arange(ps, dtype=np.int64)
                by_slot[c].append(((held[len(held) - len(ids):, None].astype(np.int64) * ps + lane).reshape(-1),
                                   (ids[:, None] * ps + lane).reshape(-1)))
            elif not np.array_equal(ids, held):  # kvplan lists the request's own pages
                raise InputError(room, f"state component {comp.name!r}: SGLang's {comp.kind.value} list "
                                       f"{ids[:8].tolist()}... is not the request's pages {held[:8].tolist()}...")

    def decode_prefix_len(self, room: int) -> int:
        """The decode side's cached prefix for ``room`` (tokens it already holds), from its lists; 0 before
        they arrived."""
        if self.mode is not DisaggregationMode.PREFILL or self.prefill is None:
            return 0
        peers = self._peers_of(room)
        return int(self.prefill.peers[peers[0]].lists[room][2]) if peers else 0
