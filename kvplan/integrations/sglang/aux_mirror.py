"""SGLang's aux rows on the KV pools' device (:class:`AuxMirror`), for engines that move one memory kind.

On a GPU SGLang keeps its aux buffers (``MetadataBuffers``: each request's first output token, its
logprobs, hidden states for speculative decoding) in host memory, beside KV pools in device memory.
kvplan's engines register a side with one memory kind, and its staging and ``ipc`` kernels read and
write aux rows on the device, so each aux buffer in host memory gets a device buffer of the same
size (its mirror), and kvplan plans and moves the mirror's rows instead:

* a prefill copies the aux rows of a step's last chunks into its mirror on the scheduler's stream,
  queued before the plan that reads them (:meth:`AuxMirror.upload`: one host-to-device copy per step);
* a decode copies a completed request's rows out of its mirror into SGLang's buffers on its endpoint's
  progress thread, before the request is reported complete (:meth:`AuxMirror.download`, the endpoint's
  ``on_complete``).

The setting ``aux_mirror`` (:mod:`.settings`) says which buffers: ``auto`` those in host memory when the
pools are on a GPU; ``always`` every buffer in host memory (on a CPU too); ``never`` none, and a manager
whose aux rows are in host memory beside device pools is refused at start.

Example::

    mirror = AuxMirror.for_buffers(side.aux, torch.device("cuda", 0), "auto")
    side = dataclasses.replace(side, aux=mirror.entries)     # what kvplan registers and plans
    mirror.upload([3, 7])                                    # prefill: rows 3 and 7 before the plan
    mirror.download([5], deadline=time.monotonic() + 5)      # decode: row 5 into SGLang's buffers
"""

from __future__ import annotations

import ctypes
import time
from typing import Callable, Sequence

import torch

from ...errors import LayoutError
from ...planner.contract.batch import Entry
from ...transport.memory_kind import memory_kind

__all__ = ["AUX_MIRROR_CHOICES", "AuxMirror"]

AUX_MIRROR_CHOICES = ("auto", "always", "never")
_PACE_S = 20e-6  # between two looks at a download's event (a copy of a few KiB takes about as long)


def _host_rows(entry: Entry) -> torch.Tensor:
    """A ``[num_items, item_len]`` uint8 view of a host buffer that SGLang owns (no copy)."""
    raw = (ctypes.c_uint8 * (entry.num_items * entry.item_len)).from_address(entry.base_ptr)
    return torch.frombuffer(raw, dtype=torch.uint8).view(entry.num_items, entry.item_len)


class AuxMirror:
    """Device copies of the aux buffers that live in host memory (see the module docstring).

    ``entries``: SGLang's aux buffers; ``mirrored``: the positions of those to mirror on ``device``.
    :attr:`entries` is then what kvplan registers and plans: the mirror's buffer where one is mirrored,
    SGLang's own elsewhere. :attr:`nbytes` is the device memory it takes."""

    def __init__(self, entries: Sequence[Entry], mirrored: Sequence[int], device: torch.device):
        self.device = device
        self.mirrored = tuple(sorted(set(mirrored)))
        self._host = {i: _host_rows(entries[i]) for i in self.mirrored}
        self._mirror = {i: torch.zeros((entries[i].num_items, entries[i].item_len), dtype=torch.uint8, device=device)
                        for i in self.mirrored}
        self.entries = tuple(Entry(self._mirror[i].data_ptr(), e.item_len, e.num_items) if i in self._mirror else e
                             for i, e in enumerate(entries))
        self.nbytes = sum(t.numel() for t in self._mirror.values())
        self._rows = min((e.num_items for e in self.entries), default=0)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @classmethod
    def for_buffers(cls, entries: Sequence[Entry], device: torch.device, setting: str = "auto",
                    kind_of: Callable[[int], str] = memory_kind) -> "AuxMirror | None":
        """The mirror ``setting`` asks for over these aux buffers on the pools' ``device``, or None where
        nothing is mirrored. ``kind_of`` names an address's memory (``"VRAM"`` or ``"DRAM"``).

        Raises :class:`LayoutError` for ``never`` where an aux buffer is in host memory beside pools on a
        GPU (the engine would be handed both kinds), naming the setting.

        >>> entries = [Entry(0x1000, 64, 4), Entry(0x2000, 32, 4)]
        >>> kinds = {0x1000: "DRAM", 0x2000: "VRAM"}
        >>> m = AuxMirror.for_buffers(entries, torch.device("cpu"), "auto", kinds.get)
        >>> m is None     # pools on a CPU: both kinds are host memory to kvplan's engines
        True
        """
        if setting not in AUX_MIRROR_CHOICES:
            raise LayoutError(f"aux_mirror {setting!r} is not one of {list(AUX_MIRROR_CHOICES)}")
        host = [i for i, e in enumerate(entries) if kind_of(e.base_ptr) == "DRAM"]
        if not host or (device.type != "cuda" and setting != "always"):
            return None
        if setting == "never":
            raise LayoutError(f"SGLang's aux buffers {host} are in host memory and the KV pools on {device}; kvplan's "
                              "engines move one memory kind: set kvplan's aux_mirror to auto (a device copy of "
                              "each, moved instead)")
        return cls(entries, host, device)

    def upload(self, rows: Sequence[int]) -> None:
        """Queue copies of aux ``rows`` from SGLang's buffers into the mirror on the caller's current
        stream (the plan that reads them is queued after it there); never waits for the device. Rows
        outside the buffers are left for the planner to refuse, naming their request."""
        rows = sorted({int(r) for r in rows if 0 <= int(r) < self._rows})
        if not rows or not self.mirrored:
            return
        at = torch.tensor(rows, dtype=torch.int64)
        packed = torch.cat([self._host[i][at] for i in self.mirrored], dim=1)  # (one copy to the device per step)
        if self.device.type == "cuda":
            packed, at = packed.pin_memory(), at.pin_memory()
        on_device, at = packed.to(self.device, non_blocking=True), at.to(self.device, non_blocking=True)
        for i, columns in self._columns():
            self._mirror[i][at] = on_device[:, columns]

    def download(self, rows: Sequence[int], deadline: float) -> None:
        """Copy aux ``rows`` from the mirror into SGLang's buffers, waiting (paced, until ``deadline``) for
        this copy alone on a stream of the mirror's own: on a decode endpoint's progress thread, for
        requests whose bytes have all landed. Raises :class:`TimeoutError` past the deadline."""
        rows = sorted({int(r) for r in rows if 0 <= int(r) < self._rows})
        if not rows or not self.mirrored:
            return
        at = torch.tensor(rows, dtype=torch.int64)
        if self._stream is None:
            packed = torch.cat([self._mirror[i][at] for i in self.mirrored], dim=1)
        else:
            with torch.cuda.stream(self._stream):  # (not the device's default stream: the forward pass runs there)
                at_device = at.to(self.device, non_blocking=True)
                on_device = torch.cat([self._mirror[i][at_device] for i in self.mirrored], dim=1)
                packed = torch.empty(on_device.shape, dtype=torch.uint8, pin_memory=True)
                packed.copy_(on_device, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
            while not done.query():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the copy of aux rows {rows[:8]} to host memory did not end by its deadline")
                time.sleep(_PACE_S)
        for i, columns in self._columns():
            self._host[i][at] = packed[:, columns]

    def _columns(self) -> list[tuple[int, slice]]:
        """Each mirrored buffer and its columns in a packed ``[rows, sum of item lengths]`` tensor."""
        out, start = [], 0
        for i in self.mirrored:
            out.append((i, slice(start, start + self._mirror[i].shape[1])))
            start += self._mirror[i].shape[1]
        return out
