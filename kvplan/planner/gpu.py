"""The GPU planner: a whole batch planned by Triton kernels, without a sync on the caller's stream.

:func:`plan` does the host-side bookkeeping that needs only lengths the scheduler already has
(chunk ranges, list lengths, policies, destination-list bounds: errors there are raised at once),
ships every small host array to the device in one asynchronous copy, and launches the kernels:
index lists (one launch for token-table lists, one per slot map), the allocator-invariant check,
run boundaries (two passes), and descriptor expansion. It returns a :class:`PendingPlan`; its
``event`` fires when the device work and the first hand-off copy are done. :meth:`PendingPlan.result`
raises the errors the kernels found (naming the request) and returns the same
:class:`~kvplan.planner.plan.Plan` the NumPy reference returns, bit for bit.

The same code runs on CPU tensors under ``TRITON_INTERPRET=1`` and on CUDA tensors.

Example::

    from kvplan.planner.gpu import plan
    pending = plan(batch)            # returns at once; kernels run on the current stream
    ...                              # the scheduler goes on
    result = pending.result()        # waits for the event; raises PlanError on bad input
    descs, offsets = result.descriptors()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import InputError, LayoutError, LengthMismatchError
from ..kernels import descriptors as kd
from ..kernels import index_lists as ki
from ..kernels import prepared as kp
from ..kernels import runs as kr
from .model import Batch, Policy, StateKind
from .pairing import Mode, SidePairing, pair_sides
from .plan import ComponentPlan, Plan, TransferPlan, empty_descs, empty_runs
from .prepared import AUX as _AUX
from .prepared import KV as _KV
from .prepared import PreparedIndices, prepared_slots
from .lists import ListJob, Packer, Segment, as_device_tensor, component_segment, host_empty, pages_segment, raise_list_errors
from .reference import check_aux, check_bounds, check_row, paired_length, resolve_chunk

__all__ = ["PendingPlan", "plan"]




@dataclass
class _TransferInfo:
    request: Any
    dest: int
    mode: Mode
    start: int
    end: int
    last: bool
    sent: bool
    dst_pages: np.ndarray
    segments: list[int] = field(default_factory=list)


def _device_of(batch: Batch) -> torch.device:
    table = batch.src.req_to_token
    return table.device if isinstance(table, torch.Tensor) else torch.device("cpu")


class _Builder:
    """Host-side bookkeeping of one batch: segments, flat destination lists, entry tables."""

    def __init__(self, batch: Batch, table_shape: tuple[int, int]):
        self.batch = batch
        self.rows, self.max_ctx = table_shape
        self.segments: list[Segment] = []
        self.expansion: list[tuple[int, int, tuple[int, ...] | None]] = []  # (entry_off, entries, head slice)
        self.dst_lists: list[np.ndarray] = []
        self.transfers: list[_TransferInfo] = []
        self.pairings = [pair_sides(batch.src, d) for d in batch.dsts]
        self.entry_blocks: list[np.ndarray] = []
        self.entry_index: dict[tuple[int, int], tuple[int, int]] = {}
        count = 0
        for d, pairing in enumerate(self.pairings):
            tables = [(_KV, pairing.kv_src, pairing.kv_dst), (_AUX, pairing.aux_src, pairing.aux_dst)]
            tables += [(c, s, t) for c, (s, t) in enumerate(zip(pairing.state_src, pairing.state_dst))]
            for role, src_t, dst_t in tables:
                block = np.zeros((len(src_t), 4), dtype=np.uint64)
                block[:, 0], block[:, 1], block[:, 2], block[:, 3] = src_t[:, 0], dst_t[:, 0], src_t[:, 1], dst_t[:, 1]
                self.entry_blocks.append(block)
                self.entry_index[(d, role)] = (count, len(block))
                count += len(block)

    def _add(self, seg: Segment, dst: np.ndarray, head_slice: tuple[int, ...] | None = None) -> None:
        d = self.transfers[seg.owner].dest
        self.expansion.append((*self.entry_index[(d, seg.role)], head_slice))
        self.transfers[seg.owner].segments.append(len(self.segments))
        self.segments.append(seg)
        self.dst_lists.append(np.asarray(dst, dtype=np.int64))

    # -- one transfer ----------------------------------------------------------------------
    def add_transfer(self, index: int) -> None:
        batch, t = self.batch, self.batch.transfers[index]
        src, policy, request = batch.src, batch.policy, t.request
        if not 0 <= t.dest < len(self.pairings):
            raise InputError(request, f"destination {t.dest} is not one of the batch's {len(self.pairings)} destinations")
        pairing: SidePairing = self.pairings[t.dest]
        dst_side = batch.dsts[t.dest]
        ps = src.kv.page_size
        chunk = resolve_chunk(t, ps, (self.rows, self.max_ctx), dst_side.kv.num_pages, policy)
        end, n, dst_pages, last, sent = chunk.end, chunk.pages, chunk.dst_pages, chunk.last, chunk.sent
        info = _TransferInfo(request, t.dest, pairing.mode, t.start, end, last, sent, dst_pages)
        self.transfers.append(info)
        seg = pages_segment(index, t.src_row, t.start, end, ps, src.kv.num_pages, batch.validate, n if sent else 0)
        head_slice = None
        if sent and pairing.mode is Mode.HEAD_SLICED:
            h = pairing.heads
            head_slice = (ps, h.src_token_bytes, h.dst_token_bytes, h.src_head * h.bytes_per_head,
                          h.dst_head * h.bytes_per_head, h.nbytes)
        if sent or seg.check is not None:  # a chunk that is not sent still gets its slots checked
            self._add(seg, dst_pages if sent else dst_pages[:0], head_slice)
        if not last:
            return
        seq = min(t.fill_len, t.prompt_len)
        if len(t.dst_state) != len(src.state):
            raise LengthMismatchError(request, f"{len(src.state)} state components on the source, {len(t.dst_state)} destination lists")
        for c, (comp, dst_list) in enumerate(zip(src.state, t.dst_state)):
            what = f"state component {comp.name}"
            always_strict = comp.kind in (StateKind.SWA_RING, StateKind.MAMBA)
            if comp.kind in (StateKind.SWA, StateKind.DSA):
                check_row(request, (self.rows, self.max_ctx), t.src_row, seq)
            seg = component_segment(index, c, comp, ps, t.src_row, seq, batch.validate)
            n_src = seg.n
            seg.n = paired_length(request, what, n_src, len(dst_list), policy, always_strict)
            dst_list = dst_list[: seg.n]
            if (seg.n == 0) != (len(dst_list) == 0) and policy is Policy.STRICT:
                raise LengthMismatchError(request, f"{what}: one side is empty")
            check_bounds(request, f"destination {dst_side.state[c].name}", dst_list, 0, dst_side.state[c].num_items)
            self._add(seg, dst_list)
        if check_aux(t, src, dst_side):
            self._add(Segment(index, _AUX, ki.CONST, 0, t.aux_src, 1, 1, 0, 1 << 62, what="aux"),
                      np.array([t.aux_dst], dtype=np.int64))


@dataclass
class PendingPlan:
    """A plan whose device work may still run. ``event`` fires when it is done (CUDA only)."""

    event: torch.cuda.Event | None
    _builder: _Builder
    _host: dict[str, torch.Tensor]
    _device: dict[str, torch.Tensor]
    _keep: list[Any]
    _sections: dict[str, Any] | None = None
    _result: Plan | None = None

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def result(self) -> Plan:
        """Wait for the device, raise the first error found there, and return the plan."""
        if self._result is None:
            if self.event is not None:
                self.event.synchronize()
            self._raise_device_errors()
            self._result = self._assemble()
        return self._result

    def descriptors(self) -> tuple[np.ndarray, np.ndarray]:
        """The engine hand-off: all descriptors ``[n, 3]`` uint64 and per-transfer offsets ``[T + 1]``.

        Equal to ``result().descriptors()`` but without building the per-transfer views: after
        the event, the device errors are checked and exactly ``n`` rows are copied into pinned
        host memory.
        """
        if self.event is not None:
            self.event.synchronize()
        self._raise_device_errors()
        total = int(self._host["total_descs"].numpy()[0])
        device_descs = self._device["descs"][:total]
        host = host_empty(total * 3, torch.int64, device_descs.device)
        host.copy_(device_descs.reshape(-1))
        desc_off = self._host["seg_desc_off"].numpy()
        firsts = [info.segments[0] if info.segments else None for info in self._builder.transfers]
        offsets = np.empty(len(firsts) + 1, dtype=np.int64)
        offsets[-1] = total
        for i in range(len(firsts) - 1, -1, -1):
            offsets[i] = desc_off[firsts[i]] if firsts[i] is not None else offsets[i + 1]
        return host.numpy().view(np.uint64).reshape(-1, 3), offsets

    def device_descriptors(self) -> torch.Tensor:
        """All descriptors as an int64 ``[n, 3]`` tensor on the planning device, for in-process
        execution (:mod:`kvplan.transport.local`); waits for the event and raises device errors first."""
        if self.event is not None:
            self.event.synchronize()
        self._raise_device_errors()
        return self._device["descs"][: int(self._host["total_descs"].numpy()[0])]

    def prepared_indices(self) -> PreparedIndices:
        """The int32 index arrays for NIXL prepared lists (needs ``plan(..., prepared=True)``)."""
        if self._sections is None:
            raise InputError(None, "this plan was made without prepared=True")
        if self.event is not None:
            self.event.synchronize()
        self._raise_device_errors()
        sections = self._sections
        return PreparedIndices(self._host["prep_src"].numpy().copy(), self._host["prep_dst"].numpy().copy(),
                               sections["offsets"], sections["role"], sections["transfer"])

    # -- decoding --------------------------------------------------------------------------
    def _raise_device_errors(self) -> None:
        b = self._builder
        raise_list_errors(b.segments, [info.segments for info in b.transfers], lambda i: b.transfers[i].request,
                          self._host["errors"].numpy(), self._host["invariant"].numpy(), self._host["src"].numpy(),
                          self._builder_seg_off, b.batch.policy)

    def _assemble(self) -> Plan:
        b = self._builder
        src_flat = self._host["src"].numpy()
        dst_flat = np.concatenate(b.dst_lists) if b.dst_lists else np.zeros(0, np.int64)
        run_start = self._host["seg_run_start"].numpy()
        desc_off = self._host["seg_desc_off"].numpy()
        total_descs = int(self._host["total_descs"].numpy()[0])
        descs = self._device["descs"][:total_descs].cpu().numpy().view(np.uint64).reshape(-1, 3)
        total_runs = int(run_start[-1])
        run_elem = self._device["run_elem"][:total_runs].cpu().numpy()
        seg_off = self._builder_seg_off
        n_flat = len(src_flat)
        out = []
        for info in b.transfers:
            kv = (np.zeros(0, np.int64), info.dst_pages[:0], empty_runs(), empty_descs())
            state, aux = [], empty_descs()
            for s in info.segments:
                seg = b.segments[s]
                lo, n = seg_off[s], seg.n
                src_list, dst_list = src_flat[lo : lo + n].copy(), dst_flat[lo : lo + n].copy()
                elems = run_elem[run_start[s] : run_start[s + 1]]
                nxt = np.append(run_elem[run_start[s] + 1 : run_start[s + 1] + 1], n_flat)[: len(elems)]
                runs = np.stack([src_flat[elems], dst_flat[elems], nxt - elems], axis=1).astype(np.int64)
                _, entries, head_slice = b.expansion[s]
                count = len(elems) * entries if head_slice is None else entries * n * head_slice[0]
                seg_descs = descs[desc_off[s] : desc_off[s] + count]
                if seg.role == _KV:
                    kv = (src_list, dst_list, runs.reshape(-1, 3), seg_descs)
                elif seg.role == _AUX:
                    aux = seg_descs
                else:
                    comp = b.batch.src.state[seg.role]
                    if comp.kind is StateKind.MAMBA:
                        runs = empty_runs()
                    state.append(ComponentPlan(comp.name, comp.kind, src_list, dst_list, runs.reshape(-1, 3), seg_descs))
            out.append(TransferPlan(
                request=info.request, dest=info.dest, mode=info.mode, start=info.start, end=info.end, last=info.last,
                sent=info.sent, src_pages=kv[0], dst_pages=kv[1], runs=kv[2],
                kv_descs=kv[3] if info.sent else empty_descs(), state=tuple(state), aux_descs=aux))
        return Plan(tuple(out))

    @property
    def _builder_seg_off(self) -> np.ndarray:
        counts = np.array([s.n for s in self._builder.segments], dtype=np.int64)
        return np.cumsum(counts) - counts


def plan(batch: Batch, stream: torch.cuda.Stream | None = None, block: int = 1024,
         prepared: bool = False) -> PendingPlan:
    """Plan ``batch`` with the kernels; nothing here waits for the device.

    Errors visible from lengths alone are raised here; errors only the kernels can see are raised
    by :meth:`PendingPlan.result`. ``block`` is the number of list elements per program.
    ``prepared=True`` also computes the index arrays for NIXL prepared lists (direct mode only).
    """
    table = batch.src.req_to_token
    if table is None:
        raise InputError(None, "the source side needs its token table (req_to_token)")
    device = _device_of(batch)
    table = as_device_tensor(table, device, "req_to_token")
    if table.dtype != torch.int32 or table.dim() != 2:
        raise InputError(None, f"req_to_token must be a 2-D int32 tensor, got {table.dtype} {tuple(table.shape)}")
    builder = _Builder(batch, tuple(table.shape))
    for i in range(len(batch.transfers)):
        builder.add_transfer(i)
    maps = {c: as_device_tensor(comp.slot_map, device, f"slot_map of component {comp.name}", torch.int64)
            for c, comp in enumerate(batch.src.state) if comp.slot_map is not None}
    slots = None
    if prepared:
        if any(p.mode is not Mode.DIRECT for p in builder.pairings):
            raise LayoutError("prepared lists are per page: head-sliced transfers need descriptors")
        slots = [prepared_slots(batch.src, d) for d in batch.dsts]
    if device.type == "cuda":
        stream = stream or torch.cuda.current_stream(device)
        with torch.cuda.stream(stream):
            return _launch(builder, table, maps, device, block, stream, slots)
    return _launch(builder, table, maps, device, block, None, slots)


def _prepared_layout(builder: _Builder, counts: np.ndarray, slots: list[dict]) -> dict[str, np.ndarray]:
    """Per segment ``(entries, src_slots, dst_slots, out_off)`` and the sections they form."""
    table = np.zeros((max(1, len(counts)), 4), dtype=np.int64)
    ids, size = [], 0
    for i, seg in enumerate(builder.segments):
        info = builder.transfers[seg.owner]
        if seg.role == _KV and not info.sent:
            continue  # a chunk that is not sent has no KV section
        entries, s_slots, d_slots = slots[info.dest][seg.role]
        table[i] = (entries, s_slots, d_slots, size)
        ids.append(i)
        size += entries * seg.n
    ids_arr = np.array(ids, dtype=np.int64)
    offsets = np.append(table[ids_arr, 3], size) if ids else np.zeros(1, np.int64)
    return {"table": table, "ids": ids_arr, "size": size, "offsets": offsets,
            "role": np.array([builder.segments[i].role for i in ids], np.int64),
            "transfer": np.array([builder.segments[i].owner for i in ids], np.int64)}


def _launch(builder: _Builder, table: torch.Tensor, maps: dict[int, torch.Tensor], device: torch.device, block: int,
            stream: torch.cuda.Stream | None, slots: list[dict] | None) -> PendingPlan:
    segs = builder.segments
    S = len(segs)
    pk = Packer()
    lists = ListJob(segs, maps, pk, block)
    counts, seg_off, n_flat = lists.counts, lists.seg_off, lists.total
    spans = {"dst": pk.add(np.concatenate(builder.dst_lists) if S else np.zeros(0, np.int64))}
    run_ps, run_po = ki.programs_over(counts, block)
    first_prog = np.searchsorted(run_ps, np.arange(S))
    spans["runs"] = (pk.add(run_ps), pk.add(run_po), pk.add(first_prog))
    spans["seg_off"], spans["seg_n"] = pk.add(seg_off), pk.add(counts)
    spans["entries"] = pk.add(np.concatenate(builder.entry_blocks) if builder.entry_blocks else np.zeros((0, 4), np.uint64))
    entry_off = np.array([x[0] for x in builder.expansion], dtype=np.int64)
    seg_entries = np.array([x[1] for x in builder.expansion], dtype=np.int64)
    head_slices = np.array([x[2] or (0,) * kd.HS_FIELDS for x in builder.expansion], np.int64).reshape(-1, kd.HS_FIELDS)
    sliced = head_slices[:, 0] > 0
    direct_entries = np.where(sliced, 0, seg_entries)
    hs_count = np.where(sliced, seg_entries * counts * head_slices[:, 0], 0)
    spans["seg_entry_off"], spans["seg_entries"] = pk.add(entry_off), pk.add(seg_entries)
    spans["direct_entries"], spans["hs_count"] = pk.add(direct_entries), pk.add(hs_count)
    spans["hs"] = pk.add(head_slices)
    hs_ids = np.flatnonzero(sliced).astype(np.int64)
    hps, hpo = ki.programs_over(counts[hs_ids] * head_slices[hs_ids, 0], block)
    spans["hs_progs"] = (pk.add(hs_ids[hps] if len(hs_ids) else hps[:0]), pk.add(hpo))
    sections = None
    if slots is not None:
        sections = _prepared_layout(builder, counts, slots)
        pps, ppo = ki.programs_over(counts[sections["ids"]], block)
        spans["prep"] = (pk.add(sections["table"]), pk.add(sections["ids"][pps] if len(pps) else pps), pk.add(ppo))
    staging = pk.ship(device)
    view = pk.view
    src, errors, invariant = lists.launch(table)
    dst = view(spans["dst"])
    seg_off_d, seg_n_d = view(spans["seg_off"]), view(spans["seg_n"])
    if S:
        run_elem, run_seg, seg_run_start = kr.find_runs(src, dst, seg_off_d, seg_n_d, view(spans["runs"][0]),
                                                        view(spans["runs"][1]), view(spans["runs"][2]), block)
        seg_runs = seg_run_start[1:] - seg_run_start[:-1]
        desc_count = seg_runs * view(spans["direct_entries"]) + view(spans["hs_count"])
        desc_end = torch.cumsum(desc_count, 0)
        seg_desc_off = desc_end - desc_count
        total_descs = desc_end[-1:]
    else:
        run_elem = run_seg = torch.zeros(1, dtype=torch.int64, device=device)
        seg_run_start = torch.zeros(1, dtype=torch.int64, device=device)
        seg_desc_off = torch.zeros(0, dtype=torch.int64, device=device)
        total_descs = torch.zeros(1, dtype=torch.int64, device=device)
    capacity = int((counts * direct_entries).sum() + hs_count.sum())
    descs = torch.empty((max(1, capacity), 3), dtype=torch.int64, device=device)
    entries = view(spans["entries"])
    max_direct = int(direct_entries.max()) if S else 0
    kd.direct_descriptors(run_elem, run_seg, seg_run_start, n_flat, src, dst, view(spans["seg_entry_off"]),
                          view(spans["direct_entries"]), seg_desc_off, entries, descs, n_flat, max_direct, 256)
    hs_ps, hs_po = spans["hs_progs"]
    max_hs = int(seg_entries[hs_ids].max()) if len(hs_ids) else 0
    kd.head_sliced_descriptors(view(hs_ps), view(hs_po), seg_off_d, seg_n_d, view(spans["hs"]), src, dst,
                               view(spans["seg_entry_off"]), view(spans["seg_entries"]), seg_desc_off, entries, descs,
                               max_hs, block)
    host = {}
    if sections is not None:
        prep_src = torch.empty(max(1, sections["size"]), dtype=torch.int32, device=device)
        prep_dst = torch.empty_like(prep_src)
        table_span, ps_span, po_span = spans["prep"]
        max_entries = int(sections["table"][:, 0].max())
        kp.prepared_indices(src, dst, seg_off_d, seg_n_d, view(ps_span), view(po_span), view(table_span),
                            prep_src, prep_dst, max_entries, block)
        for name, tensor in (("prep_src", prep_src), ("prep_dst", prep_dst)):
            h = host_empty(sections["size"], torch.int32, device)
            h.copy_(tensor[: sections["size"]], non_blocking=True)
            host[name] = h
    small = (("errors", errors), ("invariant", invariant), ("src", src[:n_flat]), ("seg_run_start", seg_run_start),
             ("seg_desc_off", seg_desc_off), ("total_descs", total_descs))
    packed = torch.cat([tensor for _, tensor in small])  # one device-to-host copy for all of them
    landing = host_empty(packed.numel(), torch.int64, device)
    landing.copy_(packed, non_blocking=True)
    at = 0
    for name, tensor in small:
        host[name] = landing[at : at + tensor.numel()]
        at += tensor.numel()
    event = None
    if stream is not None:
        event = torch.cuda.Event()
        event.record(stream)
    return PendingPlan(event, builder, host, {"descs": descs, "run_elem": run_elem},
                       [staging, pk.device_buffer, src, packed], sections)
