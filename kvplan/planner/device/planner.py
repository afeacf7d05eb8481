"""The device planner: one object per side pairing, a whole batch planned by a fixed set of launches.

:class:`Planner` is made once for a source side and its destinations (FlashInfer's
``plan()``/``run()`` split is the model). It owns the static tables (entries, destinations,
components) on the device, and per capacity bucket its buffers and, on a GPU, a captured CUDA
graph. Per batch, :meth:`Planner.plan` writes the batch's columns into a pinned buffer (a few NumPy
assignments), then replays the graph (or issues the launches), and records an event. Everything
else happens on the device: the batch layout (:mod:`kvplan.kernels.batch_layout`), lists and run
flags, token checks, run compaction, totals and the verdict on errors, and the output forms.
Nothing waits for the device until the caller consumes the plan.

Capacities come in power-of-two buckets of transfers and destination elements, as serving
engines bucket their graph batch sizes, so batches of any shape within a bucket replay one graph.
A batch beyond every bucket so far simply opens a new one.

Output forms (``outputs``), each written by a kernel into device memory; consuming a plan copies
exactly its output (the size is known once the event fired) into pinned host memory on the
planner's own copy stream, at the copy engine's bandwidth, never waiting on the caller's stream:

* ``"descriptors"``: ``[n, 3]`` uint64 ``(src, dst, nbytes)`` for NIXL direct;
* ``"prepared"``: int32 index arrays for NIXL prepared lists;
* ``"runs"``: the compact form ``(src_page, dst_page, len)`` per run plus the entry tables, for
  engines that expand entries x runs themselves;
* ``"device_descriptors"``: ``[n, 3]`` on the device, for staged mode and local copies;
* ``"byte_offsets"`` (with descriptors): each descriptor's offset in the plan's byte stream, on the
  device, and each section's byte end in the host report, so that staged mode needs no launch and
  no second round trip of its own to place a plan's bytes in its staging slots;
* none of these: counts and errors only.

Example::

    planner = Planner(prefill_side, [decode_side], graphs=True)
    for columns in scheduler_steps:            # BatchColumns, or a Batch
        pending = planner.plan(columns)        # no sync: returns after the graph launch
        descs, offsets = pending.descriptors() # waits for the event; raises PlanError naming a request
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from ...errors import InputError
from ...kernels import batch_layout as kl
from ...kernels import require_runnable
from ...kernels import elements as ke
from ...kernels import expand as kx
from ...kernels import run_table as kr
from ...kernels import summary as ks
from ..contract.batch import Batch, Policy, SideMemory
from .buffers import Buffers, Slot, current_stream, pow2, replay
from .columns import COLUMNS, BatchColumns
from .pending import PendingPlan
from .tables import StaticTables

__all__ = ["OUTPUTS", "Planner"]

log = logging.getLogger(__name__)

OUTPUTS = ("descriptors", "prepared", "runs", "device_descriptors", "byte_offsets")


class Planner:
    """Plans batches from ``src`` to ``dsts`` on the token table's device.

    Args:
        src: the planning side, with its token table and slot maps on the planning device.
        dsts: the destinations a batch's ``dest`` column indexes.
        policy, validate: as in :class:`~kvplan.planner.contract.batch.Batch`.
        outputs: which output forms to produce (see the module docstring).
        graphs: capture each bucket's launches in a CUDA graph (default: on a CUDA device).
        depth: buffers per bucket; a plan's outputs stay valid until ``depth`` more plans of its
            bucket have been made.
        block: list elements per program (256 measured fastest on an H200 against 512 and 1024).
    """

    def __init__(self, src: SideMemory, dsts: Sequence[SideMemory], *, policy: Policy | str = Policy.STRICT,
                 validate: bool = True, outputs: Sequence[str] = ("descriptors",), graphs: bool | None = None,
                 depth: int = 2, block: int = 256):
        unknown = set(outputs) - set(OUTPUTS)
        if unknown:
            raise InputError(None, f"unknown output forms {sorted(unknown)}; choose from {OUTPUTS}")
        if depth < 1 or block < 16 or block & (block - 1):
            raise InputError(None, f"depth must be >= 1 and block a power of two >= 16, got {depth}, {block}")
        self.src, self.dsts = src, tuple(dsts)
        self.policy, self.validate = Policy(policy), bool(validate)
        self.outputs = frozenset(outputs)
        self.static = StaticTables(src, self.dsts, "prepared" in self.outputs)
        self.table, self.device = self.static.table, self.static.device
        require_runnable(self.device.type)
        cuda = self.device.type == "cuda"
        self.graphs = cuda if graphs is None else bool(graphs)
        if self.graphs and not cuda:
            raise InputError(None, "CUDA graphs need the token table on a CUDA device")
        self.depth, self.block = depth, block
        self.programs = 4 * torch.cuda.get_device_properties(self.device).multi_processor_count if cuda else 2
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.check_stream = torch.cuda.Stream(self.device) if cuda else None
        self._rings: dict[tuple[int, int], list[Slot]] = {}
        self._turns: dict[tuple[int, int], int] = {}
        self._warm: set[tuple[int, int]] = set()
        self.replays = 0

    # -- per batch ------------------------------------------------------------------------------
    def plan(self, batch: Batch | BatchColumns, stream: torch.cuda.Stream | None = None) -> "PendingPlan":
        """Plan one batch on ``stream`` (default: the current stream); nothing here waits for the device."""
        columns = self._columns(batch)
        key = (pow2(columns.num_transfers, 8), pow2(len(columns.dst_flat), 64))
        if self.device.type != "cuda":
            slot = Slot(self._buffers(key))
            slot.buffers.fill(columns)
            self._launch(slot.buffers)
            return PendingPlan(self, columns, slot, 0)
        if not self.graphs:
            slot = Slot(self._buffers(key))
            slot.buffers.fill(columns)
            stream = stream or torch.cuda.current_stream(self.device)
            with torch.cuda.stream(stream):
                self._launch(slot.buffers)
            slot.event = torch.cuda.Event()
        else:
            slot = self._next_slot(key)
            slot.buffers.fill(columns)
            if slot.graph is not None and stream is None:  # the hot path: no stream switch, no new objects
                replay(slot.graph)
                self.replays += 1
                stream = current_stream(self.device)
            else:
                stream = stream or torch.cuda.current_stream(self.device)
                with torch.cuda.stream(stream):
                    if slot.graph is None and key in self._warm:
                        self._capture(slot, stream)
                    if slot.graph is None:  # the bucket's first plan runs eagerly: it compiles the kernels
                        self._warm.add(key)
                        self._launch(slot.buffers)
                    else:
                        replay(slot.graph)
                        self.replays += 1
            slot.event = slot.event or torch.cuda.Event()  # reused: the slot's last use has ended
        slot.event.record(stream)
        slot.generation += 1
        return PendingPlan(self, columns, slot, slot.generation)

    def warm_up(self, max_transfers: int, elements_per_transfer: int, stream: torch.cuda.Stream | None = None) -> int:
        """Make every bucket a batch of at most ``max_transfers`` transfers, each with at most
        ``elements_per_transfer`` destination-list entries, can fall in ready now: its buffers
        allocated, the kernels compiled and, with graphs, each of its ``depth`` slots captured, so that
        the first such batch replays a graph as a steady one does (measured: a first batch cost
        250-760 ms against 2-5 ms). Buckets up to ``max_transfers`` transfers, each with element
        capacities up to what that many transfers can hold; memory grows with the largest (about
        four times one bucket's at the top). Runs on ``stream`` (default: a stream of its own) and
        waits for it, never for the caller's. Returns how many buckets were made ready (none off the GPU).

        Example::

            planner.warm_up(max_transfers=128, elements_per_transfer=129)  # 8k-token prompts, page 64
        """
        if max_transfers < 1 or elements_per_transfer < 1:
            raise InputError(None, f"warm_up needs at least one transfer of one element, got {max_transfers} "
                             f"x {elements_per_transfer}")
        keys = []
        t = pow2(max_transfers, 8)
        while t >= 8:
            e = pow2(min(t, max_transfers) * elements_per_transfer, 64)
            while e >= 64:
                keys.append((t, e))
                e //= 2
            t //= 2
        if self.device.type != "cuda":
            return 0  # (off the GPU a plan keeps nothing per bucket and compiles nothing: nothing to warm)
        # a stream of its own by default: warming never waits for what the caller has queued (a forward pass)
        stream = stream or torch.cuda.Stream(self.device)
        for key in keys:
            with torch.cuda.stream(stream):
                for slot in self._rings.get(key) or [self._next_slot(key) for _ in range(self.depth)]:
                    slot.buffers.inp_host[0] = 0  # an empty batch: every launch runs, nothing is listed
                    if key not in self._warm:
                        self._launch(slot.buffers)
                        self._warm.add(key)
                    if self.graphs and slot.graph is None:
                        self._capture(slot, stream)
        stream.synchronize()
        return len(keys)

    def _columns(self, batch: Batch | BatchColumns) -> BatchColumns:
        if isinstance(batch, Batch):
            if batch.src is not self.src or len(batch.dsts) != len(self.dsts) or any(
                    a is not b for a, b in zip(batch.dsts, self.dsts)):
                raise InputError(None, "this batch's sides are not the planner's")
            if batch.policy is not self.policy or batch.validate != self.validate:
                raise InputError(None, "this batch's policy or validation differ from the planner's")
            return BatchColumns.from_batch(batch)
        if not isinstance(batch, BatchColumns):
            raise InputError(None, f"plan takes a Batch or BatchColumns, got {type(batch).__name__}")
        if batch.table.shape[1] != len(COLUMNS) + 2 * self.static.C:
            raise InputError(None, f"the columns describe {batch.num_components} state components, "
                             f"the source side has {self.static.C}")
        return batch

    def _next_slot(self, key: tuple[int, int]) -> Slot:
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = [Slot(self._buffers(key)) for _ in range(self.depth)]
        turn = self._turns.get(key, 0)
        self._turns[key] = turn + 1
        slot = ring[turn % self.depth]
        if slot.event is not None:
            slot.event.synchronize()  # the plan made `depth` plans ago may still be on the device
        return slot

    def _buffers(self, key: tuple[int, int]) -> Buffers:
        return Buffers(self.static, self.outputs, key[0], key[1], self.device)

    def _capture(self, slot: Slot, stream: torch.cuda.Stream) -> None:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(stream)
        # thread-local: a forward pass that other threads run meanwhile (streaming in layer groups,
        # docs/layerwise.md) must not invalidate the capture, nor the capture stall it. Not through
        # ``torch.cuda.graph``: entering it synchronizes the whole device (and empties the allocator's
        # caches), so a bucket's captures would wait for everything the caller has queued.
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                self._launch(slot.buffers)
            finally:
                graph.capture_end()
        stream.wait_stream(side)
        slot.graph = graph

    def _launch(self, b: Buffers) -> None:
        """Every step of one plan, on the current stream."""
        st, block, programs = self.static, self.block, self.programs
        b.inp.copy_(b.inp_host, non_blocking=True)
        count = b.inp[:1]
        cols = b.inp[1 : 1 + b.ncol * b.t_cap]
        dst_flat = b.inp[1 + b.ncol * b.t_cap :]
        kl.lay_out(cols, count, st.dest_meta, st.comp_meta, b.seg, b.seg_end, b.chk_end, b.seg_err, b.xfer,
                   rows=self.table.shape[0], max_ctx=self.table.shape[1], src_pages=self.src.kv.num_pages,
                   src_aux_items=min((e.num_items for e in self.src.aux), default=0), num_dests=len(self.dsts),
                   t_cap=b.t_cap, components=st.C, page_size=self.src.kv.page_size,
                   strict=self.policy is Policy.STRICT, validate=self.validate, has_aux=bool(self.src.aux),
                   units=st.units)
        # the token checks and the list elements are independent (both only or error bits into
        # seg_err): on a GPU the checks run on a side stream, a parallel branch of the graph
        fork = self.check_stream is not None
        if fork:
            here = torch.cuda.current_stream(self.device)
            self.check_stream.wait_stream(here)
            with torch.cuda.stream(self.check_stream):
                ke.check_tokens(b.seg, b.chk_end, self.table, st.maps, b.seg_err, programs, block)
        ke.list_elements(b.seg, b.seg_end, self.table, st.maps, dst_flat, b.src, b.dst, b.starts, b.seg_err, st.own,
                         b.claimed, b.claim_word, segments_per_transfer=st.K, block=block, units=st.units)
        if fork:
            here.wait_stream(self.check_stream)
        else:
            ke.check_tokens(b.seg, b.chk_end, self.table, st.maps, b.seg_err, programs, block)
        torch.cumsum(b.starts, 0, out=b.run_id)
        kr.compact_runs(b.starts, b.run_id, b.seg_end[-1:], b.run_first, b.run_last, b.claim_word, b.claimed, block)
        ks.summarize(b.seg, b.seg_end, b.run_id, b.seg_err, b.seg_sums, b.head, b.keep, segments_per_transfer=st.K,
                     strict=self.policy is Policy.STRICT)
        if b.descs is not None:
            kx.descriptors(b.seg, b.seg_sums, b.head, b.src, b.dst, b.run_first, b.run_last, st.entries, st.heads,
                           b.descs, segments_per_transfer=st.K, programs=programs, block=block)
        if b.byte_ends is not None:  # (torch ops: inside the graph they cost the host nothing)
            torch.cumsum(b.descs[:, 2], 0, out=b.byte_ends)
            torch.sub(b.byte_ends, b.descs[:, 2], out=b.byte_starts)
            seg_end = b.seg_sums[2]  # each segment's descriptor end (exclusive)
            last = (seg_end - 1).clamp_(0, b.byte_ends.numel() - 1)
            torch.index_select(b.byte_ends, 0, last, out=b.seg_bytes)
            b.seg_bytes.mul_(seg_end > 0)
        if b.live_rows is not None:
            torch.mul(b.head[int(ks.TOTAL_DESCS) : int(ks.TOTAL_DESCS) + 1],
                      b.head[int(ks.FIRST_FATAL) : int(ks.FIRST_FATAL) + 1].eq(int(ks.NONE)), out=b.live_rows)
        if b.prep_src is not None:
            kx.prepared_indices(b.seg, b.seg_sums, b.head, b.src, b.dst, st.slots, b.prep_src, b.prep_dst,
                                segments_per_transfer=st.K, programs=programs, block=block)
        if b.runs is not None:
            kr.runs_out(b.run_id, b.run_first, b.run_last, b.src, b.dst, b.runs, programs, block)
        b.report_host.copy_(b.report, non_blocking=True)

