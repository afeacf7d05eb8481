"""A plan whose device work may still run (:class:`PendingPlan`), and what it gives the host: the
verdict (the first bad request, by the host's own rules), descriptors, prepared indices, compact
runs, sections, byte offsets, and views of its device buffers for work queued behind it.

Example::

    pending = planner.plan(columns)
    descs, offsets = pending.descriptors()   # waits for the plan's event; raises PlanError naming a request
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch

from ...errors import InputError
from ...kernels import segments as sg
from ...kernels import summary as ks
from ..contract.batch import Batch, Policy, SideMemory
from ..contract.claims import Claims, check_claims
from ..contract.pairing import Mode
from ..contract.plan import ComponentPlan, Plan, Role, Section, TransferPlan, empty_descs, empty_runs
from ..contract.state_kinds import rules_of
from ..reference.expand import direct_descriptors, head_sliced_descriptors, scaled_tables, unit_runs
from ..reference.page_mapping import unit_tables
from ..reference.transfer_lists import transfer_lists
from .buffers import Buffers, OnStream, Slot
from .columns import BatchColumns
from .lists import host_empty
from .prepared import AUX, KV, PreparedIndices
from .tables import StaticTables, pairing_tables

__all__ = ["CompactRuns", "DeviceAhead", "PendingPlan", "PlanSource"]


class PlanSource(Protocol):
    """What a pending plan reads of the planner that made it."""

    src: SideMemory
    dsts: tuple[SideMemory, ...]
    policy: Policy
    validate: bool
    static: StaticTables
    device: torch.device
    copy_stream: torch.cuda.Stream | None


@dataclass(frozen=True)
class CompactRuns:
    """The compact output form: per segment its runs ``(src_page, dst_page, len)``, and the entry tables.

    ``runs[segment_runs[s] : segment_runs[s + 1]]`` are the runs of segment ``s`` (transfer
    ``s // segments_per_transfer``, slot KV, components, aux); with ``first, count = entry_span[s]``,
    ``entries[first : first + count]`` are its ``(src_base, dst_base, src_item, dst_item, nbytes)``
    rows, ``nbytes`` the bytes a run moves per item (``src_item``, except for the sliced entries of
    TP-sliced state, docs/tp_state.md §4). An engine expands entry x run itself: ``(src_base +
    src_page * src_item, dst_base + dst_page * dst_item, len * nbytes)``.
    """

    runs: np.ndarray
    segment_runs: np.ndarray
    entry_span: np.ndarray
    entries: np.ndarray
    segments_per_transfer: int



class DeviceAhead(NamedTuple):
    """A plan's device buffers before the host has seen it (:meth:`PendingPlan.device_ahead`)."""

    descs: torch.Tensor  # int64 [capacity, 3]
    byte_offsets: torch.Tensor  # int64 [capacity]: each descriptor's offset in the plan's byte stream
    rows: torch.Tensor  # int64 [1]: how many rows are the plan's (0 when it is refused)


class PendingPlan:
    """A plan whose device work may still run; its outputs are views of the planner's buffers.

    With graphs, they stay valid until ``depth`` more plans of the same bucket are made; reading a
    plan after that raises :class:`~kvplan.errors.InputError`.
    """

    def __init__(self, planner: PlanSource, columns: BatchColumns, slot: Slot, generation: int):
        self.planner, self.columns, self._slot, self._generation = planner, columns, slot, generation
        self.event = slot.event
        self._checked = False
        self._result: Plan | None = None

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def current(self) -> bool:
        """Whether this plan's buffers are still its own (``depth`` more plans of its bucket reuse them)."""
        return self._slot.generation == self._generation

    def check(self) -> None:
        """Wait for the plan and raise its first error (a :class:`~kvplan.errors.PlanError` naming the
        request); return if it planned."""
        self._head()

    @property
    def _b(self) -> Buffers:
        if self._slot.generation != self._generation:
            raise InputError(None, "this plan's buffers were reused by a later plan of its bucket: consume a plan "
                             "before `depth` more are made")
        return self._slot.buffers

    def _head(self) -> np.ndarray:
        b = self._b
        if self.event is not None:
            self.event.synchronize()
        head = b.head_host.numpy()
        if not self._checked:
            self._judge(head)
            self._checked = True
        return head

    def _judge(self, head: np.ndarray) -> None:
        """Raise the exact error of the first bad transfer (the shared host rules); log truncation warnings."""
        cols = self.columns
        if head[ks.FIRST_WARN] != int(ks.NONE):
            bits = self._to_host("seg_err", self._b.seg_err).reshape(-1, self.planner.static.K)[: cols.num_transfers]
            for t in np.flatnonzero((bits != 0).any(axis=1)):
                if t >= head[ks.FIRST_FATAL]:
                    break
                self._check_on_host(int(t))  # logs the truncation warnings
        first = int(head[ks.FIRST_FATAL])
        if first != int(ks.NONE):
            self._check_on_host(first)
            raise InputError(cols.request(first), "the device checks reject this request, the host rules accept it "
                             "(a kvplan defect: please report it with the batch)")
        if head[ks.OVERLAP]:
            p = self.planner
            batch = Batch(p.src, p.dsts, tuple(cols.transfer(t) for t in range(cols.num_transfers)), p.policy,
                          p.validate)
            check_claims([Claims.of_lists(t, transfer_lists(batch, t)) for t in batch.transfers],
                         [c.name for c in p.src.state])
            raise InputError(None, "the device found two writes to one destination item, the host rules do not "
                             "(a kvplan defect: please report it with the batch)")

    def _check_on_host(self, t: int) -> None:
        """Check transfer ``t`` on the host by the shared rules: raises its exact error, logs its warnings."""
        p = self.planner
        batch = Batch(p.src, p.dsts, (self.columns.transfer(t),), p.policy, p.validate)
        transfer_lists(batch, batch.transfers[0])

    def _to_host(self, name: str, device_values: torch.Tensor) -> np.ndarray:
        """``device_values`` in pinned host memory: one copy on the planner's copy stream, after the event."""
        p, b = self.planner, self._b
        if p.copy_stream is None:
            return device_values.numpy()
        flat = device_values.reshape(-1)
        landing = b.landing.get(name)
        if landing is None or landing.numel() < flat.numel():
            landing = b.landing[name] = host_empty(max(flat.numel(), 1 << 16), flat.dtype, p.device)
        out = landing[: flat.numel()]
        with OnStream(p.copy_stream):
            p.copy_stream.wait_event(self.event)
            out.copy_(flat, non_blocking=True)
        p.copy_stream.synchronize()
        return out.numpy().reshape(device_values.shape)

    # -- output forms --------------------------------------------------------------------------
    def _offsets(self, head: np.ndarray) -> np.ndarray:
        T = self.columns.num_transfers
        offsets = head[ks.HEAD : ks.HEAD + T + 1].copy()
        offsets[0] = 0
        return offsets

    def descriptors(self) -> tuple[np.ndarray, np.ndarray]:
        """All descriptors ``[n, 3]`` uint64 and per-transfer offsets ``[T + 1]``, in host memory.

        Waits for the event and raises the first error (a :class:`~kvplan.errors.PlanError` naming
        the request) before returning anything.
        """
        head = self._head()
        b = self._b
        total = int(head[ks.TOTAL_DESCS])
        if b.descs is None:
            raise InputError(None, "this planner makes no descriptors: add 'descriptors' to its outputs")
        return self._to_host("descs", b.descs[:total]).view(np.uint64), self._offsets(head)

    def transfer_rows(self) -> np.ndarray:
        """Per-transfer descriptor offsets ``[T + 1]`` (as :meth:`descriptors` gives them; the last is
        the descriptor count), from the host report: no descriptor is copied. Waits for the event and
        raises the first error as :meth:`descriptors` does."""
        return self._offsets(self._head())

    def device_descriptors(self) -> torch.Tensor:
        """All descriptors as int64 ``[n, 3]`` on the planning device (for staged mode and local copies)."""
        head = self._head()
        b = self._b
        if b.descs is None:
            raise InputError(None, "this planner makes no descriptors: add 'device_descriptors' to its outputs")
        return b.descs[: int(head[ks.TOTAL_DESCS])]

    def device_byte_offsets(self) -> torch.Tensor:
        """Each descriptor's offset in the plan's byte stream (int64 ``[n]`` on the planning device;
        ``"byte_offsets"`` among the outputs). Waits for the event, raises a plan's error."""
        head, b = self._head(), self._byte_buffers()
        return b.byte_starts[: int(head[ks.TOTAL_DESCS])]

    def section_byte_ends(self) -> np.ndarray:
        """Per section of :meth:`sections`, in order, the byte end of its last descriptor in the
        plan's byte stream, then the plan's total bytes (``"byte_offsets"`` among the outputs; from
        the host report, no further copy)."""
        head, b = self._head(), self._byte_buffers()
        T, K = self.columns.num_transfers, self.planner.static.K
        ends = b.seg_bytes_host.numpy()[: T * K]  # (running sums: the last segment's is the total)
        return np.append(ends[self._live_segments(head)], int(ends[-1]) if len(ends) else 0)

    def device_ahead(self) -> "DeviceAhead":
        """Without waiting for the plan (``"byte_offsets"`` among the outputs): its device buffers at
        full capacity, with the current stream made to wait for the plan. Only the first ``rows[0]``
        rows are this plan's, and ``rows`` is 0 when the plan is refused: rows past it are stale, so
        read the buffers only through it (the ``rows`` of :func:`kvplan.transport.local.gather`), or
        copy them whole and cut them once the host knows the count. ``rows`` says nothing to the host:
        :meth:`descriptors` still waits and raises a plan's error.

        Example::

            ahead = pending.device_ahead()            # queue work on ahead.descs at once
            host_descs, offsets = pending.descriptors()  # then wait for the host's view
        """
        b = self._byte_buffers()
        if self.event is not None and self.planner.device.type == "cuda":
            torch.cuda.current_stream(self.planner.device).wait_event(self.event)
        return DeviceAhead(b.descs, b.byte_starts, b.live_rows)

    def device_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Without waiting for the plan: ``(descs, rows)``, its descriptor buffer at full capacity (int64
        ``[capacity, 3]``) and the count of rows that are this plan's (int64 ``[1]``, 0 when the plan is
        refused), with the current stream made to wait for the plan. Read the buffer only through
        ``rows`` (rows past it are stale), as a launch queued behind the plan does (the ``rows`` of
        :func:`kvplan.kernels.copy.copy_descriptors`); the host learns nothing from it, and
        :meth:`descriptors` still waits and raises a plan's error.

        Example::

            descs, rows = pending.device_rows()   # launch work over them at once
            offsets = pending.transfer_rows()     # then wait for the host's view
        """
        b = self._b
        if b.descs is None:
            raise InputError(None, "this planner makes no descriptors: add 'descriptors' to its outputs")
        if self.event is not None and self.planner.device.type == "cuda":
            torch.cuda.current_stream(self.planner.device).wait_event(self.event)
        return b.descs, b.live_rows

    def _byte_buffers(self) -> Buffers:
        b = self._b
        if b.byte_starts is None:
            raise InputError(None, "this planner makes no byte offsets: add 'byte_offsets' to its outputs")
        return b

    def prepared_indices(self) -> PreparedIndices:
        """The int32 index arrays for NIXL prepared lists (``"prepared"`` among the outputs)."""
        head = self._head()
        b = self._b
        if b.prep_src is None:
            raise InputError(None, "this plan was made without prepared=True")
        K, T = self.planner.static.K, self.columns.num_transfers
        total = int(head[ks.TOTAL_PREPARED])
        keep = b.keep_host.numpy().reshape(-1, 2)[: T * K, 0] != 0
        ends = b.sums_host.numpy()[3 * b.S : 4 * b.S][: T * K][keep]
        ids = np.flatnonzero(keep)
        role = ids % K
        role = np.where(role == 0, KV, np.where(role == K - 1, AUX, role - 1))
        return PreparedIndices(self._to_host("prep_src", b.prep_src[:total]).copy(),
                               self._to_host("prep_dst", b.prep_dst[:total]).copy(),
                               np.concatenate([[0], ends]).astype(np.int64), role.astype(np.int64), ids // K)

    def sections(self) -> list[Section]:
        """What the receiver counts (as :meth:`Plan.sections`), from the plan's segment sums alone.

        Needs descriptors or prepared indices among the outputs; no per-transfer plan is assembled.
        """
        head = self._head()
        b = self._b
        if not b.sectioned:
            raise InputError(None, "this planner makes neither descriptors nor prepared indices: it has no sections")
        st = self.planner.static
        keep_n = b.keep_host.numpy().reshape(-1, 2)
        ends = b.sums_host.numpy()[2 * b.S : 3 * b.S]
        live = self._live_segments(head)
        roles = [Role.KV, *range(st.C), Role.AUX]
        names = ["kv", *(c.name for c in self.planner.src.state), "aux"]
        dests = self.columns.column("dest")
        out = []
        for s in live.tolist():
            t, k = divmod(s, st.K)
            count = 1
            if k == 0:  # the destination pages: with units of gcd tokens, rd units to a page
                rd = st.pairings[int(dests[t])].kv_units[1] if st.units else 1
                count = -(-int(keep_n[s, 1]) // rd)
            out.append(Section(t, self.columns.request(t), roles[k], names[k], int(ends[s - 1]) if s else 0,
                               int(ends[s]), count))
        return out

    def _live_segments(self, head: np.ndarray) -> np.ndarray:
        """The segments that are sections: kept, with elements and descriptors (after :meth:`_head`)."""
        b = self._b
        S = self.columns.num_transfers * self.planner.static.K
        keep_n = b.keep_host.numpy().reshape(-1, 2)[:S]
        ends = b.sums_host.numpy()[2 * b.S : 2 * b.S + S]
        starts = np.empty_like(ends)
        starts[:1] = 0
        starts[1:] = ends[:-1]
        return np.flatnonzero((keep_n[:, 0] != 0) & (keep_n[:, 1] > 0) & (ends > starts))

    def runs(self) -> CompactRuns:
        """The compact runs form (``"runs"`` among the outputs)."""
        head = self._head()
        b = self._b
        if b.runs is None:
            raise InputError(None, "this planner makes no compact runs: add 'runs' to its outputs")
        st, T = self.planner.static, self.columns.num_transfers
        total = int(head[ks.TOTAL_RUNS])
        run0 = b.sums_host.numpy()[: b.S][: T * st.K]
        span = st.entry_span[self.columns.column("dest")].reshape(-1, 2)
        return CompactRuns(b.runs[:total].numpy(), np.append(run0, total), span, st.entries_host, st.K)

    def _segment_table(self) -> np.ndarray:
        return self._to_host("seg", self._b.seg)

    def result(self) -> Plan:
        """The full plan (pages, runs, state lists, descriptors per transfer), as the reference returns it."""
        if self._result is None:
            self._result = self._assemble(self._head())
        return self._result

    def _assemble(self, head: np.ndarray) -> Plan:
        p, b, cols = self.planner, self._b, self.columns
        st, T = p.static, cols.num_transfers
        K = st.K
        seg = self._segment_table().copy()
        sums = self._to_host("seg_sums", b.seg_sums).copy()
        xfer = self._to_host("xfer", b.xfer).copy()
        n_el, n_runs = int(head[ks.ELEMENTS]), int(head[ks.TOTAL_RUNS])
        src, dst = self._to_host("src", b.src[:n_el]).copy(), self._to_host("dst", b.dst[:n_el]).copy()
        first = self._to_host("run_first", b.run_first[:n_runs]).copy()
        last = self._to_host("run_last", b.run_last[:n_runs]).copy()
        runs_all = np.stack([src[first], dst[first], last - first + 1], axis=1) if n_runs else empty_runs()
        if b.descs is not None:
            descs = self.descriptors()[0]
        else:
            descs = None
        starts = cols.column("start")
        out = []
        for t in range(T):
            dest = int(cols.column("dest")[t])
            pairing = st.pairings[dest]
            parts = []
            for k in range(K):
                s = t * K + k
                n, lo = int(seg[s, sg.F_N]), int(seg[s, sg.F_START])
                r0, nr = int(sums[0, s]), int(sums[1, s])
                d_end = int(sums[2, s])
                d_count = int(seg[s, sg.F_ENTRIES]) * (n * int(seg[s, sg.F_SLICED]) if seg[s, sg.F_SLICED] else nr)
                seg_descs = descs[d_end - d_count : d_end] if descs is not None else None
                parts.append((src[lo : lo + n].copy(), dst[lo : lo + n].copy(), runs_all[r0 : r0 + nr].copy(),
                              seg_descs))
            end, last_flag, sent = (int(x) for x in xfer[t, :3])
            kv = parts[0]
            kv = _pages_of_units(kv, pairing.kv_units)
            parts[1 : K - 1] = [_pages_of_units(part, r) for part, r in zip(parts[1 : K - 1], pairing.state_units)]
            state = ()
            if last_flag:
                state = tuple(ComponentPlan(comp.name, comp.kind, parts[1 + c][0], parts[1 + c][1],
                                            parts[1 + c][2] if rules_of(comp.kind).forms_runs else empty_runs(),
                                            self._descs(parts[1 + c], dest, 1 + c))
                              for c, comp in enumerate(p.src.state))
            out.append(TransferPlan(
                request=cols.request(t), dest=dest, mode=pairing.mode, start=int(starts[t]), end=end,
                last=bool(last_flag), sent=bool(sent), src_pages=kv[0], dst_pages=kv[1],
                runs=kv[2] if sent else empty_runs(), kv_descs=self._descs(parts[0], dest, 0) if sent else empty_descs(),
                state=state, aux_descs=self._descs(parts[K - 1], dest, K - 1) if last_flag else empty_descs()))
        return Plan(tuple(out))

    def _descs(self, part: tuple, dest: int, k: int) -> np.ndarray:
        """A segment's descriptors: the kernel's, or expanded here from its runs when none were made."""
        if part[3] is not None:
            return part[3]
        st = self.planner.static
        pairing = st.pairings[dest]
        src_t, dst_t = pairing_tables(pairing, k, st.K)
        if k == 0 and pairing.kv_units != (1, 1):
            src_t, dst_t = unit_tables(pairing, self.planner.src.kv.page_size, self.planner.dsts[dest].kv.page_size)
        if 0 < k < st.K - 1 and pairing.state_units[k - 1] != (1, 1):  # its runs count units
            p = self.planner
            src_t, dst_t = scaled_tables(src_t, dst_t, p.src.state[k - 1].pages_of(p.src.kv.page_size),
                                         p.dsts[dest].state[k - 1].pages_of(p.dsts[dest].kv.page_size))
        if k == 0 and pairing.mode is Mode.HEAD_SLICED:
            return head_sliced_descriptors(src_t, dst_t, part[0], part[1], pairing.heads, pairing.sliced_tokens)
        if 0 < k < st.K - 1 and pairing.component_heads(k - 1) is not None:
            return head_sliced_descriptors(src_t, dst_t, part[0], part[1], pairing.component_heads(k - 1),
                                           pairing.state_sliced_tokens[k - 1])
        runs = part[2]
        if k == st.K - 1 or 0 < k and not rules_of(self.planner.src.state[k - 1].kind).forms_runs:
            runs = unit_runs(part[0], part[1])
        return direct_descriptors(src_t, dst_t, runs, pairing.component_bytes(k - 1) if 0 < k < st.K - 1 else None)



def _pages_of_units(part: tuple, ratios: tuple[int, int]) -> tuple:
    """A segment's ``(src, dst, ...)`` lists of units as each side's pages, in order (a list may
    start inside its first page)."""
    if ratios == (1, 1):
        return part
    # a page starts at its first unit (unit % r == 0) or where the list does; two pages in a row may have
    # one id (an unmapped SWA page substituted by page 0 under truncate), so the ids alone cannot tell
    pages = [units[np.r_[True, units[1:] % r == 0]] // r if len(units) else units
             for units, r in zip(part[:2], ratios)]
    return (*pages, *part[2:])

