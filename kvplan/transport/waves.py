"""Staged mode's waves: contiguous ranges of a plan's descriptors that fit one staging slot.

The sender gathers a wave's source bytes into a slot of its staging buffer, the engine writes the
slot to the same slot of the receiver's buffer, and the receiver scatters it with the wave's
destination table. Slots form a ring; the receiver returns a slot's credit once it has scattered
it. A transfer larger than a slot is split over several waves; a section (what the receiver
counts) completes with the wave that holds its last descriptor.

Example::

    waves = plan_waves(sizes, sections, slot_bytes=32 << 20)
    waves[0].lo, waves[0].hi, waves[0].nbytes, waves[0].sections
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..planner.plan import Section

__all__ = ["Wave", "decode_wave_note", "plan_waves", "wave_key", "wave_note"]


@dataclass
class Wave:
    """Descriptors ``[lo, hi)`` of a plan, ``nbytes`` of them, in staging slot ``slot``."""

    index: int
    lo: int
    hi: int
    nbytes: int
    slot: int = 0
    sections: list[Section] = field(default_factory=list)

    def requests(self, owners: Sequence[Any]) -> list[Any]:
        """Every request with a descriptor in this wave (``owners[i]`` is descriptor ``i``'s request)."""
        return list(dict.fromkeys(owners[self.lo : self.hi]))


def plan_waves(sizes: np.ndarray, sections: Sequence[Section], slot_bytes: int, slots: int) -> list[Wave]:
    """Greedy waves of consecutive descriptors of at most ``slot_bytes`` each, assigned to slots in turn.

    Raises ``ValueError`` if one descriptor is larger than a slot.
    """
    sizes = np.asarray(sizes, np.int64)
    if len(sizes) and int(sizes.max()) > slot_bytes:
        raise ValueError(f"a descriptor of {int(sizes.max())} bytes does not fit a {slot_bytes}-byte staging slot")
    ends = np.cumsum(sizes)
    waves, lo, base = [], 0, 0
    while lo < len(sizes):
        hi = int(np.searchsorted(ends, base + slot_bytes, side="right"))
        waves.append(Wave(len(waves), lo, hi, int(ends[hi - 1] - base), len(waves) % slots))
        base, lo = int(ends[hi - 1]), hi
    his = np.array([w.hi for w in waves], np.int64)
    for s in sections:
        waves[int(np.searchsorted(his, s.hi, side="left"))].sections.append(s)
    return waves


def wave_note(wave: int, sender: str) -> bytes:
    """The engine notification of a staged wave (sections' notifications are JSON lists)."""
    return json.dumps({"wave": wave, "from": sender}).encode()


def wave_key(wave: int, sender: str) -> str:
    """A wave's name on the receiver: wave ids are unique per sender."""
    return f"{sender}:{wave}"


def decode_wave_note(raw: bytes) -> str | None:
    """The :func:`wave_key` of a wave notification, or ``None`` for a section notification."""
    note = json.loads(raw)
    return wave_key(int(note["wave"]), str(note["from"])) if isinstance(note, dict) else None
