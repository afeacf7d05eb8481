"""Completion tracking on the receiver: a request is complete when every KV page of every layer, its
aux row and each non-empty state component (every layer of it) have arrived.

A request gathered from several senders (TP gather, docs/tp_state.md §4) is complete only when
each of them has landed its whole part: the tracker keeps one count per sender, each against that
sender's own expectation (the components it writes), and a section from a sender the request was
not published to fails it.

A section's notification may name the model-wide layers it covers (a layer group of a streamed
send, docs/layerwise.md §3); without them it covers every layer. The tracker counts pages per KV
layer and layers per component against this side's own layout, so a request streamed in groups is
complete only once every group has landed.

Example::

    tracker = CompletionTracker(side)
    tracker.expect(published.expectation(), deadline=time.monotonic() + 30)
    tracker.on_section(decode_notification(raw))    # from the engine's notifications
    tracker.expect(other.expectation(), deadline, senders={0: None, 1: None})   # gathered from two senders
    tracker.on_section(decode_notification(raw))    # ... each note names its sender (SectionNote.sender)
    tracker.check_deadlines(time.monotonic())
    tracker.state("req-1")                          # "pending" | "complete" | "failed"
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from ..planner.device.destinations import Expectation
from ..planner.contract.batch import SideMemory
from ..planner.contract.plan import AUX_ROLE, KV_ROLE
from .stats import EndpointStats

__all__ = ["CompletionTracker", "SectionNote", "decode_notification", "encode_notification", "note_fields", "note_of"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SectionNote:
    """What a sender says when a section's bytes have landed: ``layers`` is the model-wide layer
    range ``[lo, hi)`` it covers, or ``None`` for every layer."""

    request: Any
    role: int
    name: str
    count: int
    layers: tuple[int, int] | None = None
    sender: int | None = None  # which of the receiver's senders wrote it (set where the receiver has several)


def note_fields(section: Any) -> list:
    """What the receiver is told of a section (a :class:`~kvplan.planner.contract.plan.Section` or a
    :class:`~kvplan.planner.contract.layer_groups.GroupSection`): request, role, name, count, and the layer
    bounds when it covers some layers only."""
    fields = [section.request, int(section.role), section.name, int(section.count)]
    return fields if section.layers is None else fields + [int(x) for x in section.layers]


def note_of(fields: Sequence[Any]) -> SectionNote:
    """The :class:`SectionNote` of :func:`note_fields` as they arrived (``ValueError`` if malformed)."""
    request, role, name, count, *layers = fields
    if layers and len(layers) != 2:
        raise ValueError(f"a section names {len(layers)} layer bounds, not 2")
    if int(count) < 0:
        raise ValueError(f"a section claims {count} pages")
    return SectionNote(request, int(role), str(name), int(count),
                       (int(layers[0]), int(layers[1])) if layers else None)


def encode_notification(section: Any, sender: int | None = None) -> bytes:
    """A section's engine notification (direct and prepared writes); ``sender``: the index the
    receiver gave this sender at registration, where it has several (else the bare fields)."""
    fields = note_fields(section)
    return json.dumps(fields if sender is None else {"from": int(sender), "note": fields}).encode()


def decode_notification(raw: bytes) -> SectionNote:
    """The :class:`SectionNote` of an engine notification (``ValueError`` or ``KeyError`` if malformed)."""
    message = json.loads(raw)
    if isinstance(message, dict):
        return replace(note_of(message["note"]), sender=int(message["from"]))
    return note_of(message)


_ALL = (None,)  # the one unit of a component that declares no layers


@dataclass
class _Part:
    """What one sender of a request must land, and what it has.

    KV pages are counted in two parts: ``kv_all``, the pages of notes that cover every KV layer (a
    plain send's, counted in Python: no array work on the receive loop's critical path), and
    ``kv_layered``, per KV layer, the pages of notes that name some layers (a streamed send's groups)."""

    kv_layers: int  # this side's KV layers
    components: dict[str, tuple] = field(default_factory=dict)  # name -> the layers it must land
    landed: dict[str, set] = field(default_factory=dict)  # name -> the layers that have landed
    aux: bool = False
    kv_all: int = 0
    kv_layered: np.ndarray | None = None

    def kv_most(self) -> int:
        """The most pages any KV layer has landed."""
        return self.kv_all + (int(self.kv_layered.max()) if self.kv_layered is not None else 0)

    def kv_complete(self, pages: int) -> bool:
        if not self.kv_layers:
            return True
        if self.kv_layered is None:
            return self.kv_all == pages
        return bool((self.kv_layered == pages - self.kv_all).all())

    def complete(self, e: Expectation) -> bool:
        return (self.kv_complete(e.kv_pages) and self.aux == e.aux
                and all(len(self.landed.get(n, ())) == len(layers) for n, layers in self.components.items()))


@dataclass
class _Status:
    expected: Expectation
    deadline: float
    parts: dict[int | None, _Part]  # by sender; one part keyed ``None`` when any one sender writes it all
    failure: str | None = None
    landed_all: bool = False  # every part has landed (kept by :meth:`refresh`: the receive loop asks often)
    verified: bool = True  # False until its checksum was checked, for a request that must be (.integrity)
    started: float = 0.0  # time.monotonic() when it was expected (the latency counts from there)
    nbytes: int = 0  # the bytes it was published for (counted once it completes)
    counted: bool = False  # its end is in the counters (EndpointStats)

    def refresh(self) -> None:
        self.landed_all = all(p.complete(self.expected) for p in self.parts.values())

    def complete(self) -> bool:
        return self.failure is None and self.landed_all and self.verified


class CompletionTracker:
    """Per-request progress towards its :class:`~kvplan.planner.device.destinations.Expectation`.

    ``side``: this side's layout, whose KV layers (``KVLayout.model_layers``) and components'
    declared layers are what a streamed request must land; without it every notification is taken
    to cover every layer. ``stats``: the counters a request's end is counted in (once), with its
    time from :meth:`expect` to complete (decode-ready).
    """

    def __init__(self, side: SideMemory | None = None, stats: EndpointStats | None = None) -> None:
        self._status: dict[Any, _Status] = {}
        self.stats = stats if stats is not None else EndpointStats("decode")
        self.in_flight = 0  # tracked requests neither complete nor failed (kept at each end: no scan)
        self._ended: dict[Any, str | None] = {}  # requests that ended since take_ended(): None or the reason
        self._kv_layers = np.asarray(side.kv.model_layers if side is not None else (0,), np.int64)
        self._component_layers = {c.name: tuple(sorted(set(c.layers))) or _ALL for c in side.state} \
            if side is not None else {}
        # the same layer ids as arrays, made once: a note is landed in the receive loop's critical path
        self._layer_ids = {layers: np.asarray([-1 if x is None else x for x in layers], np.int64)
                           for layers in self._component_layers.values()}

    def expect(self, expectation: Expectation, deadline: float,
               senders: dict[int, frozenset[str] | None] | None = None, verify: bool = False, nbytes: int = 0) -> None:
        """Track a request until ``deadline``. ``senders``: for a request gathered from several
        senders, each sender's index and the components it writes (``None``: all of the request's);
        each must land its whole part. ``verify``: it is complete only once :meth:`verify` says its
        bytes were checked (:mod:`.integrity`). ``nbytes``: the bytes it was published for (counted
        in :attr:`stats` once it completes)."""
        def part(names: frozenset[str] | None) -> _Part:
            components = {n: self._component_layers.get(n, _ALL) for n in expectation.components
                          if names is None or n in names}
            return _Part(len(self._kv_layers), components)

        parts = {None: part(None)} if senders is None else {int(k): part(names) for k, names in senders.items()}
        old = self._status.get(expectation.request)
        if old is not None and not old.counted:  # expected again while in flight: the earlier one is replaced
            self.in_flight -= 1
        status = self._status[expectation.request] = _Status(expectation, deadline, parts, verified=not verify,
                                                             started=time.monotonic(), nbytes=nbytes)
        self.in_flight += 1
        status.refresh()
        self._count_complete(status)

    def _count_complete(self, status: _Status) -> None:
        """Count a request that has just completed (once)."""
        if not status.counted and status.complete():
            status.counted = True
            self.in_flight -= 1
            self._ended[status.expected.request] = None
            self.stats.settled("complete", nbytes=status.nbytes)
            self.stats.latency(time.monotonic() - status.started)

    def _covered(self, layers: tuple[int, ...] | np.ndarray, note: SectionNote) -> np.ndarray:
        """Which of ``layers`` (the KV layers, or a component's) a note covers (all of them when it names none)."""
        if note.layers is None:
            return np.ones(len(layers), bool)
        ids = layers if isinstance(layers, np.ndarray) else self._layer_ids[layers]
        return (ids >= note.layers[0]) & (ids < note.layers[1])

    def on_section(self, note: SectionNote) -> None:
        self.on_sections((note,))

    def on_sections(self, notes: Sequence[SectionNote], sender: int | None = None) -> None:
        """Land several notes (a staged wave's), each request's completion looked at once after all of
        them. ``sender``: the sender that wrote them all, for notes that name none."""
        touched: dict[int, _Status] = {}
        for note in notes:
            status = self._status.get(note.request)
            if status is None:
                log.warning("a section of unknown request %r arrived (%s); ignored", note.request, note.name)
                continue
            if status.failure is not None:
                continue
            self._land(status, note, note.sender if note.sender is not None else sender)
            touched[id(status)] = status
        for status in touched.values():
            status.refresh()
            self._count_complete(status)

    def _land(self, status: _Status, note: SectionNote, sender: int | None) -> None:
        part = status.parts.get(None) or status.parts.get(sender)  # type: ignore[arg-type]
        if part is None:
            self.fail(note.request, f"received a section from sender {sender}, which the request was not "
                                    f"published to (its senders: {sorted(status.parts)})")
            return
        if note.role == KV_ROLE:
            if note.layers is None and part.kv_layers:
                part.kv_all += note.count
            else:
                covered = self._covered(self._kv_layers, note)
                if not covered.any():
                    self.fail(note.request, f"received KV of layers {note.layers}, which this side does not hold")
                    return
                if part.kv_layered is None:
                    part.kv_layered = np.zeros(part.kv_layers, np.int64)
                part.kv_layered[covered] += note.count
            if part.kv_most() > status.expected.kv_pages:
                self.fail(note.request, f"received {part.kv_most()} KV pages of a layer, expected "
                                        f"{status.expected.kv_pages}")
        elif note.role == AUX_ROLE:
            if not status.expected.aux:
                self.fail(note.request, "received its aux row, which was not published")
                return
            part.aux = True
        elif note.name in part.components:
            layers = part.components[note.name]
            covered = self._covered(layers, note) if layers != _ALL or note.layers is None else np.zeros(1, bool)
            if not covered.any():
                self.fail(note.request, f"received state component {note.name!r} for layers {note.layers}, "
                                        "which it does not hold here")
                return
            part.landed.setdefault(note.name, set()).update(x for x, c in zip(layers, covered) if c)
        else:
            self.fail(note.request, f"received state component {note.name!r}, which was not expected"
                                    + (f" from sender {note.sender}" if None not in status.parts else ""))

    def landed(self, request: Any) -> bool:
        """Whether every section of a tracked, unfailed request has landed (it may still await its check)."""
        status = self._status.get(request)
        return status is not None and status.failure is None and status.landed_all

    def verify(self, request: Any) -> None:
        """Its bytes were checked and agree: it completes once every section has landed."""
        status = self._status.get(request)
        if status is not None:
            status.verified = True
            self._count_complete(status)

    def fail(self, request: Any, reason: str) -> None:
        status = self._status.get(request)
        if status is not None:
            status.refresh()  # (a note being landed may have changed it)
            self._count_complete(status)
        if status is not None and status.failure is None and not status.complete():
            status.failure = reason
            log.warning("request %r failed: %s", request, reason)
            if not status.counted:
                status.counted = True
                self.in_flight -= 1
                self._ended[request] = reason
                self.stats.failed(reason)

    def fail_completed(self, request: Any, reason: str) -> None:
        """Fail a request that completed here but could not be finished after (an integration's
        ``on_complete`` raised): its state is ``failed`` from now on, with ``reason``. It was reported
        ended already; the counters keep it complete and count this failure too."""
        status = self._status.get(request)
        if status is not None and status.failure is None:
            status.failure = reason
            self.stats.failed(reason)

    def fail_pending(self, reason: str) -> None:
        for request in self.pending():
            self.fail(request, reason)

    def check_deadlines(self, now: float) -> list[Any]:
        """Fail every pending request whose deadline has passed; the requests it failed."""
        late = [r for r, s in self._status.items() if s.failure is None and not s.complete() and now > s.deadline]
        for request in late:
            self.fail(request, "deadline passed before its checksum was checked" if self._status[request].landed_all
                      else "deadline passed before every section arrived")
        return late

    def forget(self, request: Any) -> None:
        """Drop a settled request (the scheduler has been told); later notes about it are ignored."""
        status = self._status.pop(request, None)
        if status is not None and not status.counted:  # dropped in flight: no end to count
            self.in_flight -= 1
        self._ended.pop(request, None)

    def take_ended(self) -> dict[Any, str | None]:
        """The requests that ended (completed: ``None``; failed: the reason) since the last call, each
        once, in the order they ended: what a caller needs instead of asking every tracked request."""
        ended, self._ended = self._ended, {}
        return ended

    def __len__(self) -> int:
        return len(self._status)

    def __contains__(self, request: Any) -> bool:
        return request in self._status

    def state(self, request: Any) -> str:
        status = self._status[request]
        return "failed" if status.failure is not None else "complete" if status.complete() else "pending"

    def failure(self, request: Any) -> str | None:
        return self._status[request].failure

    def pending(self) -> list[Any]:
        return [r for r in self._status if self.state(r) == "pending"]

    def settled(self) -> bool:
        """Whether no tracked request is pending (kept as requests end: no scan)."""
        return self.in_flight == 0

    def states(self) -> dict[Any, str]:
        return {r: self.state(r) for r in self._status}
