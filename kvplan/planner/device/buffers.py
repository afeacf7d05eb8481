"""A planner's memory and streams: one :class:`Buffers` per capacity bucket and slot (pinned
input, device work space, the report and the output forms), the :class:`Slot` ring that reuses
them with their captured graphs, and the hot path's stream switch without torch's wrappers.

Example::

    key = (pow2(columns.num_transfers, 8), pow2(len(columns.dst_flat), 64))   # a capacity bucket
    slot = Slot(Buffers(tables, frozenset({"descriptors"}), *key, device))
"""

from __future__ import annotations

import torch

from ...kernels import segments as sg
from ...kernels import summary as ks
from .columns import COLUMNS, BatchColumns
from .lists import host_empty
from .tables import StaticTables

__all__ = ["Buffers", "OnStream", "Slot", "current_stream", "pow2", "replay"]



# the graph's replay without the Python wrapper's per-call checks; the public method where a torch
# build lacks the binding
replay = getattr(getattr(torch._C, "_CUDAGraph", None), "replay", None) or torch.cuda.CUDAGraph.replay
# the current stream's get and set through torch's own bindings, without the Python wrappers' device
# checks (a ``torch.cuda.stream`` switch costs 10-16 us on an H200 host); the public calls where a torch
# build lacks them
_get_current = getattr(torch._C, "_cuda_getCurrentStream", None)
_set_current = getattr(torch._C, "_cuda_setStream", None)


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)`` on the hot path (``device`` has its index)."""
    if _get_current is None:
        return torch.cuda.current_stream(device)
    stream_id, index, kind = _get_current(device.index)
    return torch.cuda.Stream(stream_id=stream_id, device_index=index, device_type=kind)


class OnStream:
    """``with torch.cuda.stream(stream)`` on the hot path: the same switch and restore of the current
    stream of ``stream``'s device."""

    def __init__(self, stream: torch.cuda.Stream):
        self.stream, self._prev, self._context = stream, None, None

    def __enter__(self) -> None:
        s = self.stream
        if _get_current is None or _set_current is None:
            self._context = torch.cuda.stream(s)
            self._context.__enter__()
            return
        self._prev = _get_current(s.device_index)
        _set_current(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)

    def __exit__(self, *exc) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)
            return
        stream_id, index, kind = self._prev
        _set_current(stream_id=stream_id, device_index=index, device_type=kind)


def pow2(n: int, least: int) -> int:
    return max(least, 1 << max(0, int(n) - 1).bit_length())



class Buffers:
    """The memory of one run at one capacity: pinned input, device work space, pinned outputs."""

    def __init__(self, st: StaticTables, outputs: frozenset[str], t_cap: int, e_cap: int, device: torch.device):
        self.t_cap, self.e_cap = t_cap, e_cap
        ncol = len(COLUMNS) + 2 * st.C
        self.ncol = ncol
        size = 1 + ncol * t_cap + e_cap
        self.inp_host = host_empty(size, torch.int64, device)
        self.inp = torch.empty(size, dtype=torch.int64, device=device)
        S = self.S = t_cap * st.K
        n_cap = e_cap * st.units_per_entry + t_cap
        z = lambda *shape: torch.empty(shape, dtype=torch.int64, device=device)  # noqa: E731
        self.seg, self.seg_end, self.chk_end, self.seg_err, self.xfer = z(S, int(sg.SEG_FIELDS)), z(S), z(S), z(S), z(t_cap, 4)
        self.src, self.dst, self.starts, self.run_id = z(n_cap), z(n_cap), z(n_cap), z(n_cap)
        self.run_first, self.run_last = z(n_cap), z(n_cap)
        # the claim bitmap: all zero between plans (each plan clears the words it set)
        self.claimed = torch.zeros(st.claim_words, dtype=torch.int32, device=device)
        self.claim_word = torch.empty(n_cap, dtype=torch.int32, device=device)
        # the report, one buffer copied to the host in one piece: the head (totals, verdicts, the
        # transfers' descriptor offsets), the segment sums and per segment whether it is a section
        # (a unit the receiver counts) and its element count
        # (with "byte_offsets", each segment's byte end follows)
        H = int(ks.HEAD) + t_cap + 1
        R = H + (7 if "byte_offsets" in outputs else 6) * S
        self.report = z(R)
        self.report_host = host_empty(R, torch.int64, device)
        self.head = self.report[:H]
        self.seg_sums = self.report[H : H + 4 * S].view(4, S)
        self.keep = self.report[H + 4 * S : H + 6 * S].view(S, 2)
        self.head_host = self.report_host[:H]
        self.sums_host = self.report_host[H : H + 4 * S]
        self.keep_host = self.report_host[H + 4 * S : H + 6 * S]
        self.seg_bytes_host = self.report_host[H + 6 * S :]
        self.sectioned = bool(outputs & {"prepared", "descriptors", "device_descriptors", "byte_offsets"})
        d_cap = st.per_element * e_cap * st.units_per_entry + st.aux_entries * t_cap
        self.descs = self.prep_src = self.prep_dst = self.runs = None
        self.byte_ends = self.byte_starts = self.seg_bytes = self.live_rows = None
        if outputs & {"descriptors", "device_descriptors", "byte_offsets"}:
            self.descs = z(d_cap, 3)
            self.live_rows = z(1)  # the descriptor count, or 0 when the plan is refused
        if "byte_offsets" in outputs:  # running byte sums of the descriptors; each segment's byte end
            self.byte_ends, self.byte_starts = z(d_cap), z(d_cap)
            self.seg_bytes = self.report[H + 6 * S :]
        if "prepared" in outputs:
            p_cap = max(1, st.per_element * e_cap * st.units_per_entry + st.aux_entries * t_cap)
            self.prep_src = torch.empty(p_cap, dtype=torch.int32, device=device)
            self.prep_dst = torch.empty(p_cap, dtype=torch.int32, device=device)
        if "runs" in outputs:  # small (one row per run): the kernel stores it straight into pinned memory
            self.runs = host_empty(3 * n_cap, torch.int64, device).view(n_cap, 3)
        self.landing: dict[str, torch.Tensor] = {}  # pinned host copies of the outputs, grown on demand

    def fill(self, columns: BatchColumns) -> None:
        inp = self.inp_host.numpy()
        T, E = columns.num_transfers, len(columns.dst_flat)
        inp[0] = T
        inp[1 : 1 + self.ncol * self.t_cap].reshape(self.ncol, self.t_cap)[:, :T] = columns.table.T
        inp[1 + self.ncol * self.t_cap : 1 + self.ncol * self.t_cap + E] = columns.dst_flat


class Slot:
    """One of a bucket's ring of buffers, with its captured graph and the event of its last use."""

    def __init__(self, buffers: Buffers):
        self.buffers = buffers
        self.graph: torch.cuda.CUDAGraph | None = None
        self.event: torch.cuda.Event | None = None
        self.generation = 0
