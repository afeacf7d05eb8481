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

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import InputError, LayoutError
from ..kernels import descriptors as kd
from ..kernels import index_lists as ki
from ..kernels import prepared as kp
from ..kernels import runs as kr
from .layout import Layout, lay_out
from .lists import ListJob, Packer, as_device_tensor, host_empty, raise_list_errors
from .model import Batch, StateKind
from .pairing import Mode
from .plan import ComponentPlan, Plan, TransferPlan, empty_descs, empty_runs
from .prepared import AUX as _AUX
from .prepared import KV as _KV
from .prepared import PreparedIndices, prepared_slots

__all__ = ["PendingPlan", "plan", "plan_inputs"]




def _device_of(batch: Batch) -> torch.device:
    table = batch.src.req_to_token
    return table.device if isinstance(table, torch.Tensor) else torch.device("cpu")


@dataclass
class PendingPlan:
    """A plan whose device work may still run. ``event`` fires when it is done (CUDA only)."""

    event: torch.cuda.Event | None
    _batch: Batch
    _layout: Layout
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
        desc_off = np.append(self._host["seg_desc_off"].numpy(), total)
        return host.numpy().view(np.uint64).reshape(-1, 3), desc_off[self._layout.seg_first]

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
        lay = self._layout
        raise_list_errors(lay.segments, lay.component_names, lambda i: lay.requests[i], self._host["errors"].numpy(),
                          self._host["invariant"].numpy(), self._host["src"].numpy(), self._seg_off,
                          self._batch.policy)

    @property
    def _seg_off(self) -> np.ndarray:
        n = self._layout.segments.n
        return np.cumsum(n) - n

    def _assemble(self) -> Plan:
        lay = self._layout
        src_flat, dst_flat = self._host["src"].numpy(), lay.dst
        run_start = self._host["seg_run_start"].numpy()
        desc_off = self._host["seg_desc_off"].numpy()
        total_descs = int(self._host["total_descs"].numpy()[0])
        descs = self._device["descs"][:total_descs].cpu().numpy().view(np.uint64).reshape(-1, 3)
        run_elem = self._device["run_elem"][: int(run_start[-1])].cpu().numpy()
        seg_off, seg = self._seg_off, lay.segments
        n_flat = len(src_flat)
        out = []
        for t in range(len(lay.requests)):
            kv = (np.zeros(0, np.int64), lay.dst_pages[t][:0], empty_runs(), empty_descs())
            state, aux = [], empty_descs()
            for s in range(lay.seg_first[t], lay.seg_first[t + 1]):
                lo, n = seg_off[s], int(seg.n[s])
                src_list, dst_list = src_flat[lo : lo + n].copy(), dst_flat[lo : lo + n].copy()
                elems = run_elem[run_start[s] : run_start[s + 1]]
                nxt = np.append(run_elem[run_start[s] + 1 : run_start[s + 1] + 1], n_flat)[: len(elems)]
                runs = np.stack([src_flat[elems], dst_flat[elems], nxt - elems], axis=1).astype(np.int64).reshape(-1, 3)
                sliced = lay.head_slices[s, 0]
                count = int(lay.entries[s]) * (n * int(sliced) if sliced else len(elems))
                seg_descs = descs[desc_off[s] : desc_off[s] + count]
                role = int(seg.role[s])
                if role == _KV:
                    kv = (src_list, dst_list, runs, seg_descs)
                elif role == _AUX:
                    aux = seg_descs
                else:
                    comp = self._batch.src.state[role]
                    runs = empty_runs() if comp.kind is StateKind.MAMBA else runs
                    state.append(ComponentPlan(comp.name, comp.kind, src_list, dst_list, runs, seg_descs))
            sent = bool(lay.sent[t])
            out.append(TransferPlan(
                request=lay.requests[t], dest=int(lay.dest[t]), mode=lay.modes[int(lay.dest[t])], start=int(lay.start[t]),
                end=int(lay.end[t]), last=bool(lay.last[t]), sent=sent, src_pages=kv[0], dst_pages=kv[1], runs=kv[2],
                kv_descs=kv[3] if sent else empty_descs(), state=tuple(state), aux_descs=aux))
        return Plan(tuple(out))


def plan_inputs(batch: Batch, prepared: bool) -> tuple[torch.Tensor, dict[int, torch.Tensor], Layout, list | None,
                                                       torch.device]:
    """Validate the batch's device inputs and lay it out: ``(table, maps, layout, slots, device)``."""
    table = batch.src.req_to_token
    if table is None:
        raise InputError(None, "the source side needs its token table (req_to_token)")
    device = _device_of(batch)
    table = as_device_tensor(table, device, "req_to_token")
    if table.dtype != torch.int32 or table.dim() != 2:
        raise InputError(None, f"req_to_token must be a 2-D int32 tensor, got {table.dtype} {tuple(table.shape)}")
    layout = lay_out(batch, tuple(table.shape))
    maps = {c: as_device_tensor(comp.slot_map, device, f"slot_map of component {comp.name}", torch.int64)
            for c, comp in enumerate(batch.src.state) if comp.slot_map is not None}
    slots = None
    if prepared:
        if any(m is not Mode.DIRECT for m in layout.modes):
            raise LayoutError("prepared lists are per page: head-sliced transfers need descriptors")
        slots = [prepared_slots(batch.src, d) for d in batch.dsts]
    return table, maps, layout, slots, device


def plan(batch: Batch, stream: torch.cuda.Stream | None = None, block: int = 1024,
         prepared: bool = False) -> PendingPlan:
    """Plan ``batch`` with the kernels; nothing here waits for the device.

    Errors visible from lengths alone are raised here; errors only the kernels can see are raised
    by :meth:`PendingPlan.result`. ``block`` is the number of list elements per program.
    ``prepared=True`` also computes the index arrays for NIXL prepared lists (direct mode only).
    """
    table, maps, layout, slots, device = plan_inputs(batch, prepared)
    if device.type == "cuda":
        stream = stream or torch.cuda.current_stream(device)
        with torch.cuda.stream(stream):
            return _launch(batch, layout, table, maps, device, block, stream, slots)
    return _launch(batch, layout, table, maps, device, block, None, slots)


def _prepared_layout(layout: Layout, slots: list[dict]) -> dict[str, np.ndarray]:
    """Per segment ``(entries, src_slots, dst_slots, out_off)`` and the sections they form."""
    seg = layout.segments
    S = len(seg)
    keep = ~((seg.role == _KV) & ~layout.sent[seg.owner]) if S else np.zeros(0, dtype=bool)  # unsent chunk: no KV section
    dest = layout.dest[seg.owner]
    table = np.zeros((max(1, S), 4), dtype=np.int64)
    for i in np.flatnonzero(keep):
        table[i, :3] = slots[int(dest[i])][int(seg.role[i])]
    sizes = table[:S, 0] * seg.n * keep
    table[:S, 3] = np.cumsum(sizes) - sizes
    ids = np.flatnonzero(keep).astype(np.int64)
    size = int(sizes.sum())
    return {"table": table, "ids": ids, "size": size, "offsets": np.append(table[ids, 3], size),
            "role": seg.role[ids], "transfer": seg.owner[ids]}


class _Job:
    """One batch's launches, decided on the host: metadata packed, grids sized. :meth:`run` issues
    them on the current stream, reading the packed metadata from ``packer.device_buffer``."""

    def __init__(self, layout: Layout, maps: dict[int, torch.Tensor], block: int, slots: list[dict] | None):
        self.layout, self.maps, self.block = layout, maps, block
        S = self.S = len(layout.segments)
        pk = self.packer = Packer()
        self.lists = ListJob(layout.segments, maps, pk, block)
        counts, seg_off = self.lists.counts, self.lists.seg_off
        self.n_flat = self.lists.total
        spans = self.spans = {"dst": pk.add(layout.dst)}
        run_ps, run_po = ki.programs_over(counts, block)
        spans["runs"] = (pk.add(run_ps), pk.add(run_po), pk.add(np.searchsorted(run_ps, np.arange(S))))
        spans["seg_off"], spans["seg_n"] = pk.add(seg_off), pk.add(counts)
        spans["entries"] = pk.add(layout.entry_table)
        seg_entries, head_slices = layout.entries, layout.head_slices
        sliced = head_slices[:, 0] > 0
        direct_entries = np.where(sliced, 0, seg_entries)
        hs_count = np.where(sliced, seg_entries * counts * head_slices[:, 0], 0)
        spans["seg_entry_off"], spans["seg_entries"] = pk.add(layout.entry_off), pk.add(seg_entries)
        spans["direct_entries"], spans["hs_count"] = pk.add(direct_entries), pk.add(hs_count)
        spans["hs"] = pk.add(head_slices)
        hs_ids = np.flatnonzero(sliced).astype(np.int64)
        hps, hpo = ki.programs_over(counts[hs_ids] * head_slices[hs_ids, 0], block)
        spans["hs_progs"] = (pk.add(hs_ids[hps] if len(hs_ids) else hps[:0]), pk.add(hpo))
        self.capacity = int((counts * direct_entries).sum() + hs_count.sum())
        self.max_direct = int(direct_entries.max()) if S else 0
        self.max_hs = int(seg_entries[hs_ids].max()) if len(hs_ids) else 0
        self.sections = None
        if slots is not None:
            self.sections = _prepared_layout(layout, slots)
            pps, ppo = ki.programs_over(counts[self.sections["ids"]], block)
            spans["prep"] = (pk.add(self.sections["table"]), pk.add(self.sections["ids"][pps] if len(pps) else pps),
                             pk.add(ppo))
        self.small_sizes = (("errors", max(S, 1) * 2), ("invariant", max(S, 1)), ("src", self.n_flat),
                            ("seg_run_start", S + 1), ("seg_desc_off", S), ("total_descs", 1))

    def key(self, table: torch.Tensor) -> tuple:
        """What a replay of a captured run must share with this one: sizes and input tensors."""
        sizes = tuple(size for _, size in self.packer_spans())
        maps = tuple((k, m.data_ptr(), m.numel()) for k, m in sorted(self.maps.items()))
        return (self.packer.size, sizes, self.capacity, self.max_direct, self.max_hs, self.n_flat, self.S, self.block,
                self.sections["size"] if self.sections else None, table.data_ptr(), tuple(table.shape), maps)

    def packer_spans(self) -> list[tuple[int, int]]:
        out = []
        for value in self.spans.values():
            out += list(value) if isinstance(value[0], tuple) else [value]
        return out

    def landing(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Host buffers the run copies its small results (and prepared indices) into."""
        out = {"small": host_empty(sum(n for _, n in self.small_sizes), torch.int64, device)}
        if self.sections is not None:
            out["prep_src"] = host_empty(self.sections["size"], torch.int32, device)
            out["prep_dst"] = host_empty(self.sections["size"], torch.int32, device)
        return out

    def run(self, table: torch.Tensor, landing: dict[str, torch.Tensor]) -> tuple[dict, dict, list]:
        """Issue every launch; returns the host views, the device results and what must stay alive."""
        device, view, S, block = table.device, self.packer.view, self.S, self.block
        spans, n_flat = self.spans, self.n_flat
        src, errors, invariant = self.lists.launch(table)
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
        descs = torch.empty((max(1, self.capacity), 3), dtype=torch.int64, device=device)
        entries = view(spans["entries"])
        kd.direct_descriptors(run_elem, run_seg, seg_run_start, n_flat, src, dst, view(spans["seg_entry_off"]),
                              view(spans["direct_entries"]), seg_desc_off, entries, descs, n_flat, self.max_direct, 256)
        hs_ps, hs_po = spans["hs_progs"]
        kd.head_sliced_descriptors(view(hs_ps), view(hs_po), seg_off_d, seg_n_d, view(spans["hs"]), src, dst,
                                   view(spans["seg_entry_off"]), view(spans["seg_entries"]), seg_desc_off, entries,
                                   descs, self.max_hs, block)
        host = {}
        keep: list[Any] = [src]
        if self.sections is not None:
            size = self.sections["size"]
            prep_src = torch.empty(max(1, size), dtype=torch.int32, device=device)
            prep_dst = torch.empty_like(prep_src)
            table_span, ps_span, po_span = spans["prep"]
            kp.prepared_indices(src, dst, seg_off_d, seg_n_d, view(ps_span), view(po_span), view(table_span),
                                prep_src, prep_dst, int(self.sections["table"][:, 0].max()), block)
            for name, tensor in (("prep_src", prep_src), ("prep_dst", prep_dst)):
                landing[name].copy_(tensor[:size], non_blocking=True)
                host[name] = landing[name]
            keep += [prep_src, prep_dst]
        tensors = {"errors": errors, "invariant": invariant, "src": src[:n_flat], "seg_run_start": seg_run_start,
                   "seg_desc_off": seg_desc_off, "total_descs": total_descs}
        packed = torch.cat([tensors[name] for name, _ in self.small_sizes])  # one device-to-host copy
        landing["small"].copy_(packed, non_blocking=True)
        at = 0
        for name, size in self.small_sizes:
            host[name] = landing["small"][at : at + size]
            at += size
        keep.append(packed)
        return host, {"descs": descs, "run_elem": run_elem}, keep


def _launch(batch: Batch, layout: Layout, table: torch.Tensor, maps: dict[int, torch.Tensor], device: torch.device,
            block: int, stream: torch.cuda.Stream | None, slots: list[dict] | None) -> PendingPlan:
    job = _Job(layout, maps, block, slots)
    staging = job.packer.ship(device)
    host, device_results, keep = job.run(table, job.landing(device))
    event = None
    if stream is not None:
        event = torch.cuda.Event()
        event.record(stream)
    return PendingPlan(event, batch, layout, host, device_results, [staging, job.packer.device_buffer, *keep],
                       job.sections)
