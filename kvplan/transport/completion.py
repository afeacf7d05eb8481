"""Completion tracking on the receiver: a request is complete when every KV page, its aux row and
each non-empty state component have arrived (components counted by id, not by sender).

Example::

    tracker = CompletionTracker()
    tracker.expect(published.expectation(), deadline=time.monotonic() + 30)
    tracker.on_section(decode_notification(raw))    # from the engine's notifications
    tracker.check_deadlines(time.monotonic())
    tracker.state("req-1")                          # "pending" | "complete" | "failed"
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from ..planner.destinations import Expectation
from ..planner.plan import AUX_ROLE, KV_ROLE, Section

__all__ = ["CompletionTracker", "SectionNote", "decode_notification", "encode_notification"]

log = logging.getLogger("kvplan")


@dataclass(frozen=True)
class SectionNote:
    """What a sender says when a section's bytes have landed."""

    request: Any
    role: int
    name: str
    count: int


def encode_notification(section: Section) -> bytes:
    return json.dumps([section.request, section.role, section.name, section.count]).encode()


def decode_notification(raw: bytes) -> SectionNote:
    request, role, name, count = json.loads(raw)
    return SectionNote(request, int(role), str(name), int(count))


@dataclass
class _Status:
    expected: Expectation
    deadline: float
    kv_pages: int = 0
    aux: bool = False
    components: set[str] = field(default_factory=set)
    failure: str | None = None

    def complete(self) -> bool:
        e = self.expected
        return (self.failure is None and self.kv_pages == e.kv_pages and self.aux == e.aux
                and self.components == set(e.components))


class CompletionTracker:
    """Per-request progress towards its :class:`~kvplan.planner.destinations.Expectation`."""

    def __init__(self) -> None:
        self._status: dict[Any, _Status] = {}

    def expect(self, expectation: Expectation, deadline: float) -> None:
        self._status[expectation.request] = _Status(expectation, deadline)

    def on_section(self, note: SectionNote) -> None:
        status = self._status.get(note.request)
        if status is None:
            log.warning("a section of unknown request %r arrived (%s); ignored", note.request, note.name)
            return
        if status.failure is not None:
            return
        if note.role == KV_ROLE:
            status.kv_pages += note.count
            if status.kv_pages > status.expected.kv_pages:
                self.fail(note.request, f"received {status.kv_pages} KV pages, expected {status.expected.kv_pages}")
        elif note.role == AUX_ROLE:
            status.aux = True
        elif note.name in status.expected.components:
            status.components.add(note.name)
        else:
            self.fail(note.request, f"received state component {note.name!r}, which was not expected")

    def fail(self, request: Any, reason: str) -> None:
        status = self._status.get(request)
        if status is not None and status.failure is None and not status.complete():
            status.failure = reason
            log.warning("request %r failed: %s", request, reason)

    def fail_pending(self, reason: str) -> None:
        for request in self.pending():
            self.fail(request, reason)

    def check_deadlines(self, now: float) -> None:
        for request, status in self._status.items():
            if status.failure is None and not status.complete() and now > status.deadline:
                self.fail(request, "deadline passed before every section arrived")

    def forget(self, request: Any) -> None:
        """Drop a settled request (the scheduler has been told); later notes about it are ignored."""
        self._status.pop(request, None)

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
        return not self.pending()

    def states(self) -> dict[Any, str]:
        return {r: self.state(r) for r in self._status}
