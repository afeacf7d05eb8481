"""Staged mode's waves: contiguous ranges of a plan's descriptors that fit one staging slot.

The sender gathers a wave's source bytes into a slot of its staging buffer, the engine writes the
slot to the same slot of the receiver's buffer, and the receiver scatters it with the wave's
destination table. Slots form a ring; the receiver returns a slot's credit once it has scattered
it. A transfer larger than a slot is split over several waves; a section (what the receiver
counts) completes with the wave that holds its last descriptor.

A run (one batch's share for one receiver) is announced by one control message ahead of its
first byte. Where the receiver can plan its own scatter, that message carries only the chunks
and each wave's bytes (:mod:`.receiver_plan`). Otherwise it is :func:`run_message`: the destination
table of every descriptor ``(dst, nbytes)``,
each request's rows of it, and per wave its id, its offset in the slot ring, its rows, its byte
count and the sections it completes. The receiver checks it with :func:`check_run` and its
landing guard, and uploads every wave's scatter inputs at once; after that a wave costs one engine
write with its notification and one credit.

Example::

    waves = plan_waves(sizes, sections, slot_bytes=32 << 20, slots=4)
    waves[0].lo, waves[0].hi, waves[0].nbytes, waves[0].sections
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..errors import PeerError
from ..planner.contract.plan import Section
from .completion import note_fields

__all__ = ["Wave", "check_run", "credit_note", "decode_credit", "decode_wave_note", "one_wave", "plan_waves", "run_message", "staging_ring", "wave_key",
           "wave_note"]


@dataclass
class Wave:
    """Descriptors ``[lo, hi)`` of a plan, ``nbytes`` of them from byte ``byte_lo`` of the plan's byte
    stream, in staging slot ``slot``."""

    index: int
    lo: int
    hi: int
    nbytes: int
    slot: int = 0
    sections: list[Section] = field(default_factory=list)
    byte_lo: int = 0

    @property
    def byte_hi(self) -> int:
        return self.byte_lo + self.nbytes

    def requests(self, owners: Sequence[Any]) -> list[Any]:
        """Every request with a descriptor in this wave (``owners[i]`` is descriptor ``i``'s request)."""
        return list(dict.fromkeys(owners[self.lo : self.hi]))


def staging_ring(capacity: int, slots: int, alignment: int) -> tuple[int, int]:
    """``(slots, slot_bytes)`` of a ring over ``capacity`` staging bytes (the smaller of the two
    sides' buffers): at most ``slots`` slots, each a multiple of ``alignment``."""
    slots = max(1, min(slots, capacity // max(alignment, 1)))
    return slots, (capacity // slots) // alignment * alignment


def plan_waves(sizes: np.ndarray, sections: Sequence[Section], slot_bytes: int, slots: int,
               ends: np.ndarray | None = None) -> list[Wave]:
    """Waves of consecutive descriptors of at most ``slot_bytes`` each, assigned to slots in turn.

    As few waves as the slot size allows, of about equal size (each wave is written as its own
    bytes, so a last wave of a few bytes would cost a write's latency for nothing). ``ends``: the
    running sum of ``sizes`` (``ends[i]``: the bytes of descriptors ``0..i``), when the caller has it
    already: a head-sliced batch has hundreds of thousands of descriptors, and the work here is then
    per wave only.

    Raises ``ValueError`` if one descriptor is larger than a slot.
    """
    if ends is None:
        ends = np.cumsum(np.asarray(sizes).astype(np.int64, copy=False))
    n = len(ends)
    total = int(ends[-1]) if n else 0
    target = -(-total // max(1, -(-total // slot_bytes))) if total else slot_bytes
    waves, lo, base = [], 0, 0
    while lo < n:
        if total - base <= slot_bytes:
            hi = n
        else:
            hi = int(np.searchsorted(ends, base + min(target, slot_bytes), side="right"))
            hi = max(hi, lo + 1)
        nbytes = int(ends[hi - 1] - base)
        if nbytes > slot_bytes:  # only a single descriptor can overflow a wave
            raise ValueError(f"a descriptor of {nbytes} bytes does not fit a {slot_bytes}-byte staging slot")
        waves.append(Wave(len(waves), lo, hi, nbytes, len(waves) % slots, byte_lo=base))
        base, lo = int(ends[hi - 1]), hi
    his = np.array([w.hi for w in waves], np.int64)
    for s in sections:
        waves[int(np.searchsorted(his, s.hi, side="left"))].sections.append(s)
    return waves


def one_wave(count: int, nbytes: int, sections: Sequence[Section]) -> list[Wave]:
    """The waves of a run of ``count`` descriptors and ``nbytes`` bytes that fits one slot: one, which
    :func:`plan_waves` would give too, made without the descriptors' sizes."""
    return [Wave(0, 0, count, nbytes, 0, list(sections))]


def wave_note(wave: int, sender: str) -> bytes:
    """The engine notification of a staged wave (sections' notifications are JSON lists, or objects
    with a ``note``: :func:`~.completion.encode_notification`)."""
    return json.dumps({"wave": wave, "from": sender}).encode()


def credit_note(wave: int) -> bytes:
    """A slot's credit sent as an engine notification: the receiver has scattered wave ``wave``."""
    return json.dumps({"credit": wave}).encode()


def decode_credit(raw: bytes) -> int | None:
    """The wave a :func:`credit_note` returns, or ``None`` for anything else."""
    try:
        note = json.loads(raw)
        return int(note["credit"]) if isinstance(note, dict) and "credit" in note else None
    except (ValueError, TypeError, OverflowError):
        return None


def touch_note(sender: str) -> bytes:
    """The notification of a warm-up's write into a decode's staging share: nothing to land (the
    receiver drops it); it makes the engine's first notification to that decode before any batch."""
    return json.dumps({"touch": sender}).encode()


def is_touch(raw: bytes) -> bool:
    """Whether an engine notification is a :func:`touch_note`."""
    return raw.startswith(b'{"touch": ')


def wave_key(wave: int, sender: str) -> str:
    """A wave's name on the receiver: wave ids are unique per sender."""
    return f"{sender}:{wave}"


def decode_wave_note(raw: bytes) -> str | None:
    """The :func:`wave_key` of a wave notification, or ``None`` for a section notification."""
    note = json.loads(raw)
    return wave_key(int(note["wave"]), str(note["from"])) if isinstance(note, dict) and "wave" in note else None


def run_message(sender: str, base_id: int, waves: Sequence[Wave], slot_bytes: int, alignment: int,
                spans: Sequence[tuple[Any, int, int]], descs: np.ndarray,
                live: Any = lambda request: True) -> tuple[dict[str, Any], bytes]:
    """The header and table frame announcing a run (see the module docstring).

    ``spans``: ``(request, lo, hi)`` rows of each request, in order, tiling the table; ``live``
    says whether a request's sections are still to be counted (a failed one's are left out).
    """
    header = {
        "from": sender, "alignment": alignment,
        "requests": [[r, int(lo), int(hi)] for r, lo, hi in spans],
        "waves": [[base_id + w.index, w.slot * slot_bytes, w.lo, w.hi, w.nbytes,
                   [note_fields(s) for s in w.sections if live(s.request)]] for w in waves],
    }
    return header, np.ascontiguousarray(descs[:, 1:], dtype=np.uint64).tobytes()


def check_run(rows: np.ndarray, spans: Sequence[tuple[Any, int, int]], waves: Sequence[Sequence[Any]],
              alignment: int, capacity: int) -> None:
    """Raise :class:`~kvplan.errors.PeerError` unless a run's shape is sound: request spans tile the
    table, waves tile it too, each wave's bytes add up and fit ``capacity`` staging bytes, and every
    size and offset is aligned. (Where the rows may write is the landing guard's to check.)"""
    n = len(rows)
    if alignment < 1 or alignment & (alignment - 1):
        raise PeerError(f"the alignment {alignment} is not a power of two")
    at = 0
    for r, lo, hi in spans:
        if lo != at or hi < lo:
            raise PeerError(f"request {r!r}'s rows [{lo}, {hi}) do not follow the previous request's (row {at})")
        at = hi
    if at != n:
        raise PeerError(f"the requests' rows cover {at} of the table's {n} rows")
    too_large = np.flatnonzero(rows[:, 1] > np.uint64(capacity)) if n else []
    if len(too_large):  # (also what a negative size reads as: it would wrap the sums below)
        k = int(too_large[0])
        raise PeerError(f"row {k} claims {int(rows[k, 1])} bytes; a wave's staging bytes are {capacity} at most")
    ends = np.zeros(n + 1, np.int64)
    np.cumsum(rows[:, 1].view(np.int64), out=ends[1:])
    at = 0
    for index, lo_in_slot, lo, hi, nbytes, _ in waves:
        lo, hi, lo_in_slot, nbytes = int(lo), int(hi), int(lo_in_slot), int(nbytes)
        if lo != at or hi < lo or hi > n:
            raise PeerError(f"wave {index}'s rows [{lo}, {hi}) do not follow the previous wave's (row {at}) within the "
                            f"table's {n} rows")
        at = hi
        if int(ends[hi] - ends[lo]) != nbytes:
            raise PeerError(f"wave {index} claims {nbytes} bytes; its rows hold {int(ends[hi] - ends[lo])}")
        if lo_in_slot < 0 or nbytes < 0 or lo_in_slot + nbytes > capacity:
            raise PeerError(f"wave {index} claims staging bytes [{lo_in_slot}, +{nbytes}); the staging buffer holds "
                            f"{capacity} for it")
        if lo_in_slot % alignment:
            raise PeerError(f"wave {index}: its staging offset is not aligned to {alignment}")
    if at != n:
        raise PeerError(f"the waves cover {at} of the table's {n} rows")
    if (rows & np.uint64(alignment - 1)).any():
        raise PeerError(f"the table's rows are not aligned to {alignment}")
