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
from dataclasses import dataclass
from math import gcd
from typing import NamedTuple, Sequence

import numpy as np
import torch

from ..errors import InputError, LayoutError
from ..kernels import batch_layout as kl
from ..kernels import require_runnable
from ..kernels import elements as ke
from ..kernels import expand as kx
from ..kernels import run_table as kr
from ..kernels import segments as sg
from ..kernels import summary as ks
from .claims import Claims, check_claims
from .columns import COLUMNS, BatchColumns
from .page_mapping import unit_tables
from .lists import as_device_tensor, host_empty, require_same_device
from .host_expand import direct_descriptors, head_sliced_descriptors, scaled_tables, unit_runs
from .model import Batch, Policy, SideMemory
from .pairing import Mode, SidePairing, pair_sides
from .plan import ComponentPlan, Plan, Role, Section, TransferPlan, empty_descs, empty_runs
from .prepared import AUX, KV, PreparedIndices, prepared_slots, require_prepared_form
from .rules import check_token_table
from .state_kinds import rules_of
from .transfer_lists import transfer_lists

__all__ = ["CompactRuns", "DeviceAhead", "PendingPlan", "Planner"]

log = logging.getLogger(__name__)

OUTPUTS = ("descriptors", "prepared", "runs", "device_descriptors", "byte_offsets")
MAX_MAPS = 4


# the graph's replay without the Python wrapper's per-call checks; the public method where a torch
# build lacks the binding
_replay = getattr(getattr(torch._C, "_CUDAGraph", None), "replay", None) or torch.cuda.CUDAGraph.replay
# the current stream's get and set through torch's own bindings, without the Python wrappers' device
# checks (a ``torch.cuda.stream`` switch costs 10-16 us on an H200 host); the public calls where a torch
# build lacks them
_get_current = getattr(torch._C, "_cuda_getCurrentStream", None)
_set_current = getattr(torch._C, "_cuda_setStream", None)


def _current_stream(device: torch.device) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)`` on the hot path (``device`` has its index)."""
    if _get_current is None:
        return torch.cuda.current_stream(device)
    stream_id, index, kind = _get_current(device.index)
    return torch.cuda.Stream(stream_id=stream_id, device_index=index, device_type=kind)


class _OnStream:
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


def _pow2(n: int, least: int) -> int:
    return max(least, 1 << max(0, int(n) - 1).bit_length())


def _token_table(side: SideMemory) -> torch.Tensor:
    check_token_table(side.req_to_token)
    table = side.req_to_token
    return torch.from_numpy(table) if isinstance(table, np.ndarray) else table


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


class _Static:
    """What does not change from batch to batch: pairings and the device tables built from them."""

    def component_sliced_tokens(self, dest: int, c: int, src: SideMemory) -> int:
        """Tokens per list element of component ``c`` when it is head-sliced to ``dest`` (its page
        size: one descriptor per entry, element and token; docs/tp_state.md), else 0."""
        heads = self.pairings[dest].component_heads(c)
        if heads is None:
            return 0
        return heads.spans_per_page(src.state[c].pages_of(src.kv.page_size))

    def sliced_tokens(self, dest: int) -> int:
        """Tokens per KV element of a head-sliced destination (one descriptor each; its page, or the
        unit between sides of different page sizes), 0 for a direct one."""
        pairing = self.pairings[dest]
        if pairing.mode is not Mode.HEAD_SLICED:
            return 0
        return pairing.heads.spans_per_page(self.unit_sizes[dest])

    def __init__(self, src: SideMemory, dsts: Sequence[SideMemory], device: torch.device, prepared: bool):
        self.pairings: list[SidePairing] = [pair_sides(src, d) for d in dsts]
        ps = src.kv.page_size
        # docs/page_sizes.md: with a destination of another page size, KV moves in units of gcd tokens
        self.unit_ratios = [_ratios(ps, d.kv.page_size) for d in dsts]
        self.unit_sizes = [gcd(ps, d.kv.page_size) for d in dsts]
        # per destination and component: (source, destination) units per page of a paged component
        # whose pages differ there (SWA, DSA; docs/page_sizes.md §6), else (1, 1)
        self.comp_ratios = [[_ratios(c.pages_of(ps), dc.pages_of(d.kv.page_size)) if rules_of(c.kind).paged else (1, 1)
                             for c, dc in zip(src.state, d.state)] for d in dsts]
        self.units = any(r != (1, 1) for r in self.unit_ratios) or any(r != (1, 1) for rs in self.comp_ratios
                                                                         for r in rs)
        if self.units and prepared:
            raise LayoutError(f"page sizes differ (source {ps}, destinations {[d.kv.page_size for d in dsts]}): "
                              "NIXL prepared lists index whole pages of one size on each side; plan descriptors "
                              "(docs/page_sizes.md §5)")
        C = self.C = len(src.state)
        K = self.K = 2 + C
        D = len(dsts)
        blocks, count = [], 0
        dest_meta = np.zeros((max(1, D), int(kl.DEST_FIELDS_BASE) + 2 * K + 4 * C), np.int64)
        heads = np.zeros((max(1, D) * K, int(kx.HEAD_FIELDS)), np.int64)  # per destination and slot
        for d, (p, side) in enumerate(zip(self.pairings, dsts)):
            kv_tables = unit_tables(p, ps, side.kv.page_size) if self.unit_ratios[d] != (1, 1) else (p.kv_src, p.kv_dst)
            comp_tables = [scaled_tables(st, dt, c.pages_of(ps), dc.pages_of(side.kv.page_size))
                           if self.comp_ratios[d][i] != (1, 1) else (st, dt)
                           for i, (st, dt, c, dc) in enumerate(zip(p.state_src, p.state_dst, src.state, side.state))]
            tables = [kv_tables, *comp_tables, (p.aux_src, p.aux_dst)]
            moved = [None, *(p.component_bytes(c) for c in range(C)), None]  # bytes per item, when not whole
            for k, (src_t, dst_t) in enumerate(tables):
                block = np.zeros((len(src_t), int(kx.ENTRY_FIELDS)), dtype=np.uint64)
                block[:, 0], block[:, 1], block[:, 2], block[:, 3] = src_t[:, 0], dst_t[:, 0], src_t[:, 1], dst_t[:, 1]
                block[:, 4] = src_t[:, 1] if moved[k] is None else moved[k]
                blocks.append(block)
                dest_meta[d, 3 + 2 * k : 5 + 2 * k] = count, len(block)
                count += len(block)
            dest_meta[d, 0] = side.kv.num_pages
            dest_meta[d, 1] = min((e.num_items for e in side.aux), default=0)
            dest_meta[d, 2] = self.sliced_tokens(d)
            dest_meta[d, 3 + 2 * K : 3 + 2 * K + C] = [c.num_items for c in side.state]
            for i, c in enumerate(side.state):
                cps_d = c.pages_of(side.kv.page_size)
                dest_meta[d, 3 + 2 * K + C + 2 * i : 5 + 2 * K + C + 2 * i] = cps_d, gcd(cps_d, src.state[i].pages_of(ps))
            unit = gcd(ps, side.kv.page_size)
            dest_meta[d, -3:] = side.kv.page_size, unit, ps * side.kv.page_size // unit
            # head slices (planning.md §5; docs/tp_state.md): KV's in slot 0, each head-sliced component's in its slot
            for k, h in enumerate([p.heads, *(p.component_heads(c) for c in range(C))]):
                if h is not None:
                    heads[d * K + k] = (h.src_token_bytes, h.dst_token_bytes, h.src_head * h.bytes_per_head,
                                        h.dst_head * h.bytes_per_head, h.nbytes)
            dest_meta[d, 3 + 2 * K + 3 * C : 3 + 2 * K + 4 * C] = [self.component_sliced_tokens(d, c, src)
                                                                   for c in range(C)]
        self.entry_span = dest_meta[:, 3 : 3 + 2 * K].reshape(-1, K, 2).copy()  # per dest and slot
        # claims (planning.md §6.1): per dest and slot, the first bit and the item count of its bitmap region
        own = np.zeros((max(1, D) * K, 2), np.int64)
        own[:, 1] = np.concatenate([[m[0], *m[3 + 2 * K : 3 + 2 * K + C], m[1]] for m in dest_meta]) if D else 0
        own[:, 0] = np.cumsum(own[:, 1]) - own[:, 1]
        self.claim_words = int(own[:, 1].sum()) // 32 + 1
        self.entries_host = np.concatenate(blocks) if blocks else np.zeros((0, int(kx.ENTRY_FIELDS)), np.uint64)
        self.maps: list[torch.Tensor] = []
        comp_meta = np.zeros((max(1, C), int(kl.COMP_FIELDS)), np.int64)
        for c, comp in enumerate(src.state):
            rules = rules_of(comp.kind)
            rules.require_map(comp)
            map_slot, map_len = -1, 0
            if rules.needs_map:
                if len(self.maps) == MAX_MAPS:
                    raise LayoutError(f"at most {MAX_MAPS} state components with slot maps are supported")
                slot_map = as_device_tensor(comp.slot_map, device, f"slot_map of component {comp.name}", torch.int64)
                map_slot, map_len = len(self.maps), slot_map.numel()
                self.maps.append(slot_map.reshape(-1))
            comp_meta[c] = (rules.layout_code, comp.window, comp.pages_of(src.kv.page_size), max(1, comp.ring_size),
                            comp.num_items, map_slot, map_len, rules.always_strict, comp.from_prefix)
        slots = np.zeros((max(1, D) * K, 2), np.int64)
        if prepared:
            require_prepared_form(src, dsts)
            for d, side in enumerate(dsts):
                for role, (_, s_slots, d_slots) in prepared_slots(src, side).items():
                    k = 0 if role == KV else K - 1 if role == AUX else 1 + role
                    slots[d * K + k] = s_slots, d_slots
        multiplier = [1]
        for d, p in enumerate(self.pairings):
            kv_entries = int(dest_meta[d, 4])
            multiplier.append(kv_entries * max(1, self.sliced_tokens(d)))
            multiplier += [int(dest_meta[d, 4 + 2 * k]) * max(1, int(dest_meta[d, 3 + 2 * K + 3 * C + k - 1]))
                           for k in range(1, K - 1)]
        self.per_element = max(multiplier)
        # list elements per destination-list entry at most (a destination page holds this many units)
        self.units_per_entry = max([r[1] for r in self.unit_ratios] + [r[1] for rs in self.comp_ratios for r in rs]
                                   + [1])
        self.aux_entries = len(src.aux)
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a).view(np.int64)).to(device)  # noqa: E731
        self.entries, self.dest_meta, self.heads, self.comp_meta, self.slots, self.own = (
            to(self.entries_host), to(dest_meta), to(heads), to(comp_meta), to(slots), to(own))
        if not self.maps:
            self.maps = [self.entries]


class _Buffers:
    """The memory of one run at one capacity: pinned input, device work space, pinned outputs."""

    def __init__(self, st: _Static, outputs: frozenset[str], t_cap: int, e_cap: int, device: torch.device):
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


class _Slot:
    """One of a bucket's ring of buffers, with its captured graph and the event of its last use."""

    def __init__(self, buffers: _Buffers):
        self.buffers = buffers
        self.graph: torch.cuda.CUDAGraph | None = None
        self.event: torch.cuda.Event | None = None
        self.generation = 0


class Planner:
    """Plans batches from ``src`` to ``dsts`` on the token table's device.

    Args:
        src: the planning side, with its token table and slot maps on the planning device.
        dsts: the destinations a batch's ``dest`` column indexes.
        policy, validate: as in :class:`~kvplan.planner.model.Batch`.
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
        self.table = _token_table(src)
        self.device = self.table.device
        require_same_device(src, self.device)
        require_runnable(self.device.type)
        cuda = self.device.type == "cuda"
        self.graphs = cuda if graphs is None else bool(graphs)
        if self.graphs and not cuda:
            raise InputError(None, "CUDA graphs need the token table on a CUDA device")
        self.depth, self.block = depth, block
        self.static = _Static(src, self.dsts, self.device, "prepared" in self.outputs)
        self.programs = 4 * torch.cuda.get_device_properties(self.device).multi_processor_count if cuda else 2
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.check_stream = torch.cuda.Stream(self.device) if cuda else None
        self._rings: dict[tuple[int, int], list[_Slot]] = {}
        self._turns: dict[tuple[int, int], int] = {}
        self._warm: set[tuple[int, int]] = set()
        self.replays = 0

    # -- per batch ------------------------------------------------------------------------------
    def plan(self, batch: Batch | BatchColumns, stream: torch.cuda.Stream | None = None) -> "PendingPlan":
        """Plan one batch on ``stream`` (default: the current stream); nothing here waits for the device."""
        columns = self._columns(batch)
        key = (_pow2(columns.num_transfers, 8), _pow2(len(columns.dst_flat), 64))
        if self.device.type != "cuda":
            slot = _Slot(self._buffers(key))
            slot.buffers.fill(columns)
            self._launch(slot.buffers)
            return PendingPlan(self, columns, slot, 0)
        if not self.graphs:
            slot = _Slot(self._buffers(key))
            slot.buffers.fill(columns)
            stream = stream or torch.cuda.current_stream(self.device)
            with torch.cuda.stream(stream):
                self._launch(slot.buffers)
            slot.event = torch.cuda.Event()
        else:
            slot = self._next_slot(key)
            slot.buffers.fill(columns)
            if slot.graph is not None and stream is None:  # the hot path: no stream switch, no new objects
                _replay(slot.graph)
                self.replays += 1
                stream = _current_stream(self.device)
            else:
                stream = stream or torch.cuda.current_stream(self.device)
                with torch.cuda.stream(stream):
                    if slot.graph is None and key in self._warm:
                        self._capture(slot, stream)
                    if slot.graph is None:  # the bucket's first plan runs eagerly: it compiles the kernels
                        self._warm.add(key)
                        self._launch(slot.buffers)
                    else:
                        _replay(slot.graph)
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
        t = _pow2(max_transfers, 8)
        while t >= 8:
            e = _pow2(min(t, max_transfers) * elements_per_transfer, 64)
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

    def _next_slot(self, key: tuple[int, int]) -> _Slot:
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = [_Slot(self._buffers(key)) for _ in range(self.depth)]
        turn = self._turns.get(key, 0)
        self._turns[key] = turn + 1
        slot = ring[turn % self.depth]
        if slot.event is not None:
            slot.event.synchronize()  # the plan made `depth` plans ago may still be on the device
        return slot

    def _buffers(self, key: tuple[int, int]) -> _Buffers:
        return _Buffers(self.static, self.outputs, key[0], key[1], self.device)

    def _capture(self, slot: _Slot, stream: torch.cuda.Stream) -> None:
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

    def _launch(self, b: _Buffers) -> None:
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

    def __init__(self, planner: Planner, columns: BatchColumns, slot: _Slot, generation: int):
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
    def _b(self) -> _Buffers:
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
        with _OnStream(p.copy_stream):
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

    def _byte_buffers(self) -> _Buffers:
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
                rd = st.unit_ratios[int(dests[t])][1] if st.units else 1
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
            kv = _pages_of_units(kv, st.unit_ratios[dest])
            parts[1 : K - 1] = [_pages_of_units(part, r) for part, r in zip(parts[1 : K - 1], st.comp_ratios[dest])]
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
        src_t, dst_t = _pairing_tables(pairing, k, st.K)
        if k == 0 and st.unit_ratios[dest] != (1, 1):
            src_t, dst_t = unit_tables(pairing, self.planner.src.kv.page_size, self.planner.dsts[dest].kv.page_size)
        if 0 < k < st.K - 1 and st.comp_ratios[dest][k - 1] != (1, 1):  # its runs count units
            p = self.planner
            src_t, dst_t = scaled_tables(src_t, dst_t, p.src.state[k - 1].pages_of(p.src.kv.page_size),
                                         p.dsts[dest].state[k - 1].pages_of(p.dsts[dest].kv.page_size))
        if k == 0 and pairing.mode is Mode.HEAD_SLICED:
            return head_sliced_descriptors(src_t, dst_t, part[0], part[1], pairing.heads, st.sliced_tokens(dest))
        if 0 < k < st.K - 1 and pairing.component_heads(k - 1) is not None:
            return head_sliced_descriptors(src_t, dst_t, part[0], part[1], pairing.component_heads(k - 1),
                                           st.component_sliced_tokens(dest, k - 1, self.planner.src))
        runs = part[2]
        if k == st.K - 1 or 0 < k and not rules_of(self.planner.src.state[k - 1].kind).forms_runs:
            runs = unit_runs(part[0], part[1])
        return direct_descriptors(src_t, dst_t, runs, pairing.component_bytes(k - 1) if 0 < k < st.K - 1 else None)


def _ratios(ps_s: int, ps_d: int) -> tuple[int, int]:
    """Units of ``gcd(ps_s, ps_d)`` tokens per page on each side."""
    unit = gcd(ps_s, ps_d)
    return ps_s // unit, ps_d // unit


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


def _pairing_tables(pairing: SidePairing, k: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    if k == 0:
        return pairing.kv_src, pairing.kv_dst
    if k == K - 1:
        return pairing.aux_src, pairing.aux_dst
    return pairing.state_src[k - 1], pairing.state_dst[k - 1]

