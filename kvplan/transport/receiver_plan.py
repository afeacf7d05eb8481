"""Staged runs whose scatter the receiver plans itself: no destination table on the wire.

In the table form (:func:`~.waves.run_message`) the sender announces a run with the destination
``(dst, nbytes)`` of every descriptor, and the receiver checks each row against what it published
before it scatters. In the planned form the sender announces only its chunks ``(request, start,
fill_len, last)`` and each wave's byte range of the run; the receiver plans the scatter with kvplan's
planner from its *own* published lists, rows, prompt and prefix lengths, as a plan from its side to
itself. Nothing the peer sends becomes an address: a chunk outside what was published fails to
plan, and a wave that does not tile the run's bytes is refused. The chunks can go ahead of the
waves (:func:`planned_run_chunks`, then :func:`planned_run_waves`): sent before the sender's plan
is launched, they let the receiver plan while the sender does. The receiver's planning runs on
the device while the sender gathers and writes, so the scatter of a landed wave waits on nothing.

Why the byte streams agree: a plan's descriptors are in transfer order, then sections (KV, each
component, aux), then entry-major, then runs in token order (planning.md §4), and a staged run
packs them back to back. A plan from the receiver to itself has the same transfers, sections,
entries and tokens in the same order; only its runs are longer (they break where the destination
breaks, not where either side does). Both streams therefore hold the same bytes for the same
destination addresses, provided the pairing sends whole destination items of equal size
(:func:`receiver_can_plan`): equal page sizes, the same destination entries, the strict policy, and
head slices only where each fills whole destination tokens (TP scatter: a source rank sends a
destination rank every head it holds, so its per-token descriptors, page after page, are the
destination's pages whole), and TP-sliced state only where each entry's blocks fill its destination
item back to back (TP scatter again: a request's one slot streams as whole items). Where a
pairing fills parts of items (a TP gather), the receiver plans from :func:`mirror_source` instead:
the sender's layout over its own lists, which has the sender's descriptors with its own addresses.
The receiver decides all this itself from the layout its sender paired with
(:func:`scatter_source`), and checks the byte total of its plan against the run's before it scatters.

Example::

    if receiver_can_plan(prefill_side, decode_side, policy):
        first = planned_run_chunks(sender_id, alignment, transfers, run=3)       # as soon as planning starts
        then = planned_run_waves(sender_id, base_id, waves, slot_bytes, run=3)
    # on the receiver:
    run = PlannedRun.announce(first, ...)
    run.set_waves(then["waves"], capacity)
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..errors import LayoutError, PeerError
from ..planner.device.columns import COLUMNS, BatchColumns
from ..planner.device.destinations import PreallocatedRequest, PublishedRequest
from ..planner.device.pending import DeviceAhead, PendingPlan
from ..planner.device.planner import Planner
from ..planner.contract.batch import Entry, Policy, SideMemory, Transfer
from ..planner.contract.pairing import SidePairing, pair_sides
from ..planner.contract.plan import Section
from .waves import Wave

__all__ = ["OwnLists", "PlannedRun", "PlannedWave", "fills_whole_items", "mirror_source", "planned_run_chunks",
           "planned_run_message", "planned_run_waves", "receiver_can_plan", "run_columns", "scatter_source"]

_START, _FILL, _LAST = COLUMNS.index("start"), COLUMNS.index("fill_len"), COLUMNS.index("last")
_LO = [COLUMNS.index("kv_lo")]  # the columns that index dst_flat (then each component's lo)


def receiver_can_plan(src: SideMemory, dst: SideMemory, policy: Policy) -> bool:
    """Whether ``dst`` plans the same byte stream from its own lists as ``src`` sends it (see the module docstring)."""
    return scatter_source(src, dst, policy) is not None


def scatter_source(src: SideMemory, dst: SideMemory, policy: Policy) -> SideMemory | None:
    """The side ``dst`` plans the scatter of ``src``'s staged runs from, or ``None`` when it cannot:

    * ``dst`` itself where the bytes fill whole destination items (:func:`fills_whole_items`): its
      runs are then as long as its own pages allow;
    * else, with equal page sizes everywhere, :func:`mirror_source`: ``src``'s layout over ``dst``'s
      own token table and slot maps (a TP gather: each source rank fills its part of each item).
    """
    if Policy(policy) is not Policy.STRICT:
        return None
    try:
        sent = pair_sides(src, dst)
    except LayoutError:
        return None
    if fills_whole_items(src, dst, sent):
        return dst
    if src.kv.page_size != dst.kv.page_size or len(src.state) != len(dst.state) or any(
            s.pages_of(src.kv.page_size) != d.pages_of(dst.kv.page_size) for s, d in zip(src.state, dst.state)):
        return None
    return mirror_source(src, dst)


def mirror_source(src: SideMemory, dst: SideMemory) -> SideMemory:
    """``src``'s layout (item lengths, TP place, heads, shards, aux) over ``dst``'s token table and slot
    maps, with pools large enough for ``dst``'s ids: planned to ``dst``, it yields ``src``'s descriptors
    for the chunks ``dst`` published, in ``src``'s order and sizes and with ``dst``'s addresses (each
    list is ``dst``'s own; equal page sizes make them the lists ``src`` sends along). Its source
    addresses are never used: the scatter reads the staging buffer."""
    def grown(entries: tuple[Entry, ...], least: int) -> tuple[Entry, ...]:
        return tuple(replace(e, num_items=max(e.num_items, least)) for e in entries)

    kv = replace(src.kv, entries=grown(src.kv.entries, max((e.num_items for e in dst.kv.entries), default=0)))
    state = tuple(replace(s, entries=grown(s.entries, max((e.num_items for e in d.entries), default=0)),
                          slot_map=d.slot_map) for s, d in zip(src.state, dst.state))
    aux = grown(src.aux, max((e.num_items for e in dst.aux), default=0))
    return SideMemory(kv, state, aux, dst.req_to_token)


def fills_whole_items(src: SideMemory, dst: SideMemory, sent: SidePairing | None = None) -> bool:
    """Whether ``src``'s bytes fill ``dst``'s items whole, so that ``dst``'s plan from its side to
    itself is the same byte stream (see the module docstring); ``sent``: ``pair_sides(src, dst)``
    when the caller has it."""
    if src.kv.page_size != dst.kv.page_size:
        return False
    try:
        sent, own = sent or pair_sides(src, dst), pair_sides(dst, dst)
    except LayoutError:
        return False
    # head slices qualify when each fills whole destination tokens (a source rank sends a destination
    # rank every head it holds: TP scatter); a gather's slices fill parts of items
    if not all(h is None or h.whole_destination for h in (sent.heads, *sent.state_heads)):
        return False
    if len(sent.state_dst) != len(own.state_dst):
        return False
    tables = [(sent.kv_dst, own.kv_dst), (sent.aux_dst, own.aux_dst)]
    for c, (sliced, whole) in enumerate(zip(sent.state_dst, own.state_dst)):
        moved = sent.component_bytes(c)
        if moved is None:
            tables.append((sliced, whole))
        elif not _blocks_tile_items(sliced, moved, sent.component_rows(c), whole):
            return False
    return all(a.shape == b.shape and (a == b).all() for a, b in tables)


def _blocks_tile_items(blocks: np.ndarray, nbytes: np.ndarray, entry_of: np.ndarray, whole: np.ndarray) -> bool:
    """Whether a component's sliced entries (``blocks``: ``(base + offset, item_len)`` rows, each
    moving ``nbytes`` per item into entry ``entry_of``) fill each destination item of ``whole`` back to
    back from its start, entry after entry (TP-sliced state in a TP scatter, docs/tp_state.md §4): a
    request's one slot then streams as whole items. A gather's blocks fill parts of items."""
    entry_of = np.asarray(entry_of, np.int64)
    if len(entry_of) == 0 or (np.diff(entry_of) < 0).any() or \
            not np.array_equal(np.unique(entry_of), np.arange(len(whole))):
        return False
    offsets = blocks[:, 0].astype(np.int64) - whole[entry_of, 0].astype(np.int64)
    ends = offsets + np.asarray(nbytes, np.int64)
    first = np.r_[True, entry_of[1:] != entry_of[:-1]]
    last = np.r_[entry_of[1:] != entry_of[:-1], True]
    follows = np.where(first, offsets == 0, offsets == np.r_[0, ends[:-1]])
    return bool(follows.all() and (ends[last] == whole[entry_of[last], 1].astype(np.int64)).all()
                and (blocks[:, 1] == whole[entry_of, 1]).all())


@dataclass(frozen=True)
class OwnLists:
    """What a receiver plans a request's chunks from, made once when it publishes the request: its
    row of :data:`~kvplan.planner.device.columns.COLUMNS` (chunk columns left zero; list offsets relative to
    ``lists``) and its lists back to back (pages, then each component's)."""

    row: np.ndarray
    lists: np.ndarray

    @classmethod
    def of(cls, allocated: PreallocatedRequest, published: PublishedRequest) -> "OwnLists":
        aux = published.aux_index if published.has_aux else -1
        parts = [published.lists.pages, *published.lists.state]
        lengths = np.array([len(x) for x in parts], np.int64)
        los = np.cumsum(lengths) - lengths
        pairs = np.stack([los, lengths], axis=1).reshape(-1)
        row = np.array([allocated.row, 0, 0, allocated.prompt_len, allocated.prefix_len, 0, 0, aux, aux,
                        len(parts) - 1, *pairs], np.int64)
        lists = np.concatenate(parts).astype(np.int64) if len(parts) else np.zeros(0, np.int64)
        return cls(row, lists)


def run_columns(chunks: Sequence[tuple[Any, int, int, bool]], own: Callable[[Any], OwnLists]) -> BatchColumns:
    """The receiver's batch of a run, from its side to itself: ``chunks`` are the announced ``(request,
    start, fill_len, last)``; everything else (row, lengths, lists) is what ``own(request)`` published.
    Chunks of one request share its lists in ``dst_flat``; no object is made per chunk."""
    requests = [c[0] for c in chunks]
    first = {r: k for k, r in enumerate(dict.fromkeys(requests))}
    records = [own(r) for r in first]
    sizes = np.array([len(o.lists) for o in records], np.int64)
    base = np.cumsum(sizes) - sizes
    which = np.array([first[r] for r in requests], np.int64)
    table = np.stack([o.row for o in records])[which] if records else np.zeros((0, len(COLUMNS)), np.int64)
    if len(chunks):
        table[:, _START] = [c[1] for c in chunks]
        table[:, _FILL] = [c[2] for c in chunks]
        table[:, _LAST] = [bool(c[3]) for c in chunks]
        lo_cols = _LO + list(range(len(COLUMNS), table.shape[1], 2))
        table[:, lo_cols] += base[which][:, None]
    lists = np.concatenate([o.lists for o in records]) if records else np.zeros(0, np.int64)
    return BatchColumns(table, lists, requests)


def planned_run_message(sender: str, base_id: int, waves: Sequence[Wave], slot_bytes: int, alignment: int,
                        transfers: Sequence[Transfer]) -> dict[str, Any]:
    """The header announcing a planned run in one message: its chunks (:func:`planned_run_chunks`)
    and its waves (:func:`planned_run_waves`)."""
    return {**planned_run_chunks(sender, alignment, transfers),
            **planned_run_waves(sender, base_id, waves, slot_bytes)}


def planned_run_chunks(sender: str, alignment: int, transfers: Sequence[Transfer], run: int | None = None
                       ) -> dict[str, Any]:
    """A planned run's chunks: what the receiver plans its scatter from. Sent alone (with the run's
    id ``run``) before the sender launches its own plan, the receiver plans while the sender
    does; its waves follow in a ``staged-waves`` message (:func:`planned_run_waves` with ``run``)."""
    header: dict[str, Any] = {"from": sender, "alignment": alignment,
                              "transfers": [[t.request, int(t.start), int(t.fill_len), bool(t.last)] for t in transfers]}
    if run is not None:
        header["run"] = run
    return header


def planned_run_waves(sender: str, base_id: int, waves: Sequence[Wave], slot_bytes: int,
                      run: int | None = None) -> dict[str, Any]:
    """A planned run's waves: per wave its id, its offset in the slot ring and its bytes ``[lo, hi)``
    of the run."""
    header: dict[str, Any] = {
        "from": sender,
        "waves": [[base_id + w.index, w.slot * slot_bytes, w.byte_lo, w.byte_hi] for w in waves]}
    if run is not None:
        header["run"] = run
    return header


@dataclass
class PlannedWave:
    """A wave of a planned run: its id, offset in this sender's staging share and bytes of the run."""

    index: int
    lo_in_share: int
    byte_lo: int
    byte_hi: int
    sections: list[Section] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.byte_hi - self.byte_lo


@dataclass
class PlannedRun:
    """A planned run on the receiver, from its announcement until its scatter inputs are known.

    ``stage`` goes ``planning`` (the plan runs on the device) -> ``ready`` (landed waves may
    scatter), or ``refused`` with ``why``.
    """

    sender: str
    requests: list[Any]
    waves: list[PlannedWave]
    alignment: int
    pending: PendingPlan | None
    stage: str = "planning"
    why: str | None = None
    descs: torch.Tensor | None = None  # the scatter descriptors ``(dst, dst, nbytes)``, the run's own copy
    starts: torch.Tensor | None = None  # each one's byte offset in the run
    _copies: tuple[torch.Tensor, torch.Tensor] | None = None  # the plan's buffers, copied behind it
    has_waves: bool = True  # False: announced by its chunks alone, its waves still to come (set_waves)
    _plan: tuple[PendingPlan, DeviceAhead] | None = None  # the plan and its buffers (recurring, see scatter_counted)

    @classmethod
    def announce(cls, header: dict[str, Any], capacity: int, own: Callable[[Any], OwnLists], planner: Planner,
                 stream: torch.cuda.Stream | None, own_alignment: int) -> "PlannedRun":
        """Check a planned run's announcement and start planning its scatter on ``stream``.

        ``own(request)`` is what the receiver published for a request (raising :class:`PeerError` for
        one it cannot plan); the run is planned by :func:`run_columns`. The copy
        word comes from the smaller of the announced alignment and ``own_alignment``
        (:func:`~.local.plan_alignment` of a plan from the side to itself), so a peer's claim never makes
        an unaligned access. Raises :class:`PeerError` (nothing planned) or :class:`~kvplan.errors.PlanError`.
        """
        sender, announced = str(header["from"]), int(header["alignment"])
        if announced < 1 or announced & (announced - 1):
            raise PeerError(f"the alignment {announced} is not a power of two")
        alignment = min(announced, own_alignment)
        chunks = [(r, int(s), int(f), bool(last)) for r, s, f, last in header["transfers"]]
        waves = cls.checked_waves(header["waves"], capacity, alignment) if "waves" in header else None
        columns = run_columns(chunks, own)
        run = cls(sender, list(dict.fromkeys(columns.requests)), waves or [], alignment, None)
        run.has_waves = waves is not None
        run.pending = planner.plan(columns, stream=stream)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            # copied behind the plan at once (later plans reuse its buffers): once the host has seen the
            # plan, a landed wave only needs its scatter launched
            ahead = run.pending.device_ahead()
            run._copies = (ahead.descs.clone(), ahead.byte_offsets.clone())
        run._plan = (run.pending, ahead)
        return run

    @staticmethod
    def checked_waves(rows: Sequence[Sequence[Any]], capacity: int, alignment: int) -> list[PlannedWave]:
        """A run's waves from its announcement, checked: they tile the run's bytes in order, each fits
        the ``capacity`` staging bytes of its sender, and every offset is aligned. Raises :class:`PeerError`."""
        waves = [PlannedWave(int(i), int(slot_lo), int(lo), int(hi)) for i, slot_lo, lo, hi in rows]
        at = 0
        for w in waves:
            if w.byte_lo != at or w.byte_hi < w.byte_lo:
                raise PeerError(f"wave {w.index}'s bytes [{w.byte_lo}, {w.byte_hi}) do not follow the previous "
                                f"wave's (byte {at})")
            if w.lo_in_share < 0 or w.lo_in_share + w.nbytes > capacity:
                raise PeerError(f"wave {w.index} claims staging bytes [{w.lo_in_share}, +{w.nbytes}); the staging "
                                f"buffer holds {capacity} for it")
            if w.lo_in_share % alignment or w.byte_lo % alignment:
                raise PeerError(f"wave {w.index}: its offsets are not aligned to {alignment}")
            at = w.byte_hi
        return waves

    def set_waves(self, rows: Sequence[Sequence[Any]], capacity: int) -> None:
        """The waves of a run announced by its chunks first (:func:`planned_run_chunks`), checked as
        :meth:`checked_waves`. Raises :class:`PeerError`."""
        if self.has_waves:
            raise PeerError("the run's waves were announced twice")
        self.waves, self.has_waves = self.checked_waves(rows, capacity, self.alignment), True

    def advance(self, stream: torch.cuda.Stream | None = None, when_ready: Callable[[], None] | None = None) -> bool:
        """Move on as far as the device allows without waiting; True once ``ready`` or ``refused``.
        One look at the plan's event: its host report holds the byte total, the sections and their
        byte ends. ``when_ready`` runs as soon as the run's bytes check and its scatter inputs are
        known, before the sections are read (a landed wave's scatter need not wait for them)."""
        if self.stage == "planning" and self.pending.ready():
            try:
                count = len(self.pending.device_descriptors())  # raises the plan's first error, naming the request
                ends = self.pending.section_byte_ends()
            except PeerError as err:
                return self._refuse(str(err))
            except ValueError as err:  # a PlanError: the chunk is not one this side published
                return self._refuse(f"the run's chunks do not plan against what this side published: {err}")
            total, claimed = int(ends[-1]), (self.waves[-1].byte_hi if self.waves else 0)
            if total != claimed:
                return self._refuse(f"the run carries {claimed} bytes; this side's plan of its chunks has {total}")
            self.descs, self.starts = self._copies[0][:count], self._copies[1][:count]
            self.stage = "ready"
            if when_ready is not None:
                when_ready()
            self._place(self.pending.sections(), ends)
            self.pending = self._copies = None
        return self.stage in ("ready", "refused")

    def _place(self, sections: list[Section], ends: np.ndarray) -> None:
        """Give each wave the sections it completes (``ends``: each section's byte end, then the total)."""
        his = np.array([w.byte_hi for w in self.waves], np.int64)
        for section, end in zip(sections, ends[:-1].tolist()):
            self.waves[int(np.searchsorted(his, end, side="left"))].sections.append(section)

    def _refuse(self, why: str) -> bool:
        self.stage, self.why, self.pending = "refused", why, None
        return True

    def scatter_counted(self) -> DeviceAhead | None:
        """For a run of one wave whose plan's buffers are still its own: those buffers at full
        capacity and the plan's row count on the device. They recur with the planner's bucket slot,
        so a scatter over them can be kept as a graph (:mod:`.copy_graphs`); ``None`` otherwise."""
        if self.stage != "ready" or len(self.waves) != 1 or self._plan is None or not self._plan[0].current():
            return None
        return self._plan[1]

    def scatter_inputs(self, wave: PlannedWave) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]:
        """The run's scatter descriptors ``(dst, dst, nbytes)``, their offsets in the run (device
        tensors) and the byte window that cuts them to ``wave`` (``None`` for a run of one wave)."""
        return self.descs, self.starts, None if len(self.waves) == 1 else (wave.byte_lo, wave.byte_hi)
