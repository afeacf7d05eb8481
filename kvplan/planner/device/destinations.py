"""The decode side: destination lists of pre-allocated requests, computed on the GPU and published.

Before a transfer can start, the decode node publishes per request its page list for
``[P, L)``, one list per state component over ``L`` (SWA window through its own slot map, DSA
pages, ring rows, Mamba slot) and its aux index (planning.md §3, §6). :func:`plan_destinations`
computes every list of a batch with the planner's kernels in a few launches, validates them
(alignment, allocator invariant, pool bounds, unmapped SWA slots) and hands them to the host with
one asynchronous copy into pinned memory; no call synchronises the caller's stream.

:meth:`PublishedRequest.message` is the wire message (planning.md §7: ``pack_int_lists`` with
int32 items: pages, then each component's list, then the aux index), and
:meth:`PublishedRequest.expectation` what the receiver must see before the request is complete;
both derive from the same lists.

Example::

    pending = plan_destinations(decode_side, [PreallocatedRequest("r1", row=3, prompt_len=8192)])
    for published in pending.result():           # waits for the event; raises on bad lists
        socket.send(published.message())
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ...compat.sglang import unpack_int_arrays
from ...errors import AlignmentError, InputError
from ...kernels import require_runnable
from .lists import ListJob, Packer, Segment, SegmentTable, as_device_tensor, component_segment, host_empty, pages_segment, raise_list_errors, require_same_device
from ..contract.batch import Policy, SideMemory
from ..contract.plan import DestinationLists
from ..contract.rules import check_bounds, check_row, check_token_table
from ..contract.state_kinds import rules_of

__all__ = ["Expectation", "PendingDestinations", "PreallocatedRequest", "PublishedRequest", "check_published",
           "decode_message", "list_entries", "plan_destinations"]


@dataclass(frozen=True)
class PreallocatedRequest:
    """A request the decode side has allocated pages (and state) for, in row ``row``."""

    request: Any
    row: int
    prompt_len: int
    prefix_len: int = 0
    aux_index: int = 0


@dataclass(frozen=True)
class Expectation:
    """What a receiver waits for: every KV page, the aux row, each component with a non-empty list."""

    request: Any
    kv_pages: int
    aux: bool
    components: tuple[str, ...]


@dataclass(frozen=True)
class PublishedRequest:
    """One request's destination lists, as the prefill side needs them."""

    request: Any
    lists: DestinationLists
    aux_index: int
    component_names: tuple[str, ...]
    has_aux: bool

    def message(self) -> bytes:
        """The wire message: ``pack_int_lists([pages, *state, [aux_index]], "i")``."""
        lists = [self.lists.pages, *self.lists.state]
        lengths = np.array([[len(x) for x in lists]], dtype=np.int64)
        return encode_messages(np.concatenate(lists), lengths, np.array([self.aux_index], dtype=np.int64))[0]

    def expectation(self) -> Expectation:
        names = tuple(n for n, ids in zip(self.component_names, self.lists.state) if len(ids))
        return Expectation(self.request, len(self.lists.pages), self.has_aux, names)


def decode_message(data: bytes, num_components: int) -> tuple[DestinationLists, int]:
    """The prefill side's view of a :meth:`PublishedRequest.message`: lists (int64) and aux index."""
    lists = unpack_int_arrays(data, "i")
    if len(lists) != num_components + 2 or len(lists[-1]) != 1:
        raise InputError(None, f"a destination message holds {len(lists)} lists; expected {num_components + 2} "
                         "(pages, one per state component, aux index)")
    as64 = [x.astype(np.int64) for x in lists]
    return DestinationLists(as64[0], tuple(as64[1:-1])), int(as64[-1][0])


def check_published(request: Any, lists: DestinationLists, aux_index: int, side: SideMemory) -> None:
    """Every id a decode side published for ``request`` lies in the pools it registered (``side``): checked
    where the lists arrive, so that a list naming pages outside them fails that request alone rather than
    the batch it would join. :class:`~kvplan.errors.PoolBoundsError` names the first id outside.

    Example::

        lists, aux = decode_message(frame, len(peer_side.state))
        check_published("req-7", lists, aux, peer_side)
    """
    check_bounds(request, "destination KV page", lists.pages, 1, side.kv.num_pages)  # (page 0: no page, as planning has it)
    for component, ids in zip(side.state, lists.state):
        check_bounds(request, f"destination {component.name}", ids, 0, component.num_items)
    if side.aux:
        check_bounds(request, "destination aux", np.array([aux_index]), 0, min(e.num_items for e in side.aux))


def encode_messages(ids: np.ndarray, list_lengths: np.ndarray, aux_indices: np.ndarray) -> list[bytes]:
    """Wire messages of many requests at once from their lists laid out back to back in ``ids``.

    ``list_lengths`` is ``[requests, lists]`` (pages, then each component); each message is
    ``pack_int_lists([*lists, [aux]], "i")``, built with whole-array NumPy operations.
    """
    requests, lists = list_lengths.shape
    if ids.size and (ids.min() < -(1 << 31) or ids.max() >= 1 << 31):
        raise InputError(None, "an index does not fit the int32 wire format")
    body = ids.astype("<i4")
    headers = np.empty((requests, lists + 2), dtype="<u4")
    headers[:, 0] = lists + 1
    headers[:, 1 : lists + 1] = list_lengths * 4
    headers[:, lists + 1] = 4
    aux = aux_indices.astype("<i4")
    ends = np.cumsum(list_lengths.sum(axis=1))
    starts = ends - list_lengths.sum(axis=1)
    return [headers[r].tobytes() + body[starts[r] : ends[r]].tobytes() + aux[r : r + 1].tobytes()
            for r in range(requests)]


@dataclass
class PendingDestinations:
    """Destination lists whose device work may still run; ``event`` fires when they are on the host."""

    event: torch.cuda.Event | None
    _side: SideMemory
    _requests: tuple[PreallocatedRequest, ...]
    _segments: list[Segment]
    _seg_off: np.ndarray
    _host: dict[str, torch.Tensor]
    _keep: list[Any]
    _checked: bool = False

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def messages(self) -> list[bytes]:
        """Every request's wire message, in request order; equal to ``[p.message() for p in result()]``
        but built from the flat host lists with whole-array NumPy operations."""
        ids = self._checked_ids()
        lengths = np.array([s.n for s in self._segments], dtype=np.int64).reshape(len(self._requests), -1)
        return encode_messages(ids, lengths, np.array([r.aux_index for r in self._requests], dtype=np.int64))

    def result(self) -> list[PublishedRequest]:
        """Wait for the event, raise the first invalid list (naming its request), split per request."""
        ids = self._checked_ids()
        names = tuple(c.name for c in self._side.state)
        per_request = len(self._segments) // max(1, len(self._requests))
        out = []
        for i, r in enumerate(self._requests):
            segs = range(i * per_request, (i + 1) * per_request)
            lists = [ids[self._seg_off[s] : self._seg_off[s] + self._segments[s].n].copy() for s in segs]
            out.append(PublishedRequest(r.request, DestinationLists(lists[0], tuple(lists[1:])), r.aux_index, names,
                                        bool(self._side.aux)))
        return out

    def _checked_ids(self) -> np.ndarray:
        if not self._checked:
            if self.event is not None:
                self.event.synchronize()
            raise_list_errors(SegmentTable.from_segments(self._segments), [c.name for c in self._side.state],
                              lambda i: self._requests[i].request,
                              self._host["errors"].numpy(), self._host["invariant"].numpy(), self._host["ids"].numpy(),
                              self._seg_off, Policy.STRICT)
            self._checked = True
        return self._host["ids"].numpy()


def list_entries(side: SideMemory, prompt_len: int) -> int:
    """How many destination-list entries one request of ``prompt_len`` tokens publishes on ``side``
    (its KV pages and each state component's list): what a planner's buffers hold per transfer of it.

    Example::

        list_entries(decode_side, 8192)   # 128 KV pages at page size 64, plus each component's list
    """
    ps = side.kv.page_size
    return -(-prompt_len // ps) + sum(rules_of(c.kind).list_shape(c, ps, prompt_len, 0).n for c in side.state)


def request_segments(side: SideMemory, requests: Sequence[PreallocatedRequest], validate: bool = True) -> list[Segment]:
    """Check ``requests`` against ``side`` on the host (what is visible from their lengths: an unaligned
    prefix, a row or range outside the table, an aux index outside the aux buffers; an error naming the
    request) and return their lists' segments: what :func:`plan_destinations` launches its kernels over.
    A started decode endpoint runs it on the caller's thread, so that a bad request raises at ``publish``."""
    if side.req_to_token is None:
        raise InputError(None, "the decode side needs its token table (req_to_token)")
    shape = tuple(side.req_to_token.shape)
    ps = side.kv.page_size
    aux_items = min((e.num_items for e in side.aux), default=0)
    segments: list[Segment] = []
    requests = tuple(requests)
    for i, r in enumerate(requests):
        if r.prefix_len % ps or not 0 <= r.prefix_len <= r.prompt_len:
            raise AlignmentError(r.request, f"decode prefix {r.prefix_len} is not a page-aligned prefix of {r.prompt_len} "
                                 f"tokens (page size {ps})")
        check_row(r.request, shape, r.row, r.prompt_len)
        if side.aux and not 0 <= r.aux_index < aux_items:
            raise InputError(r.request, f"aux index {r.aux_index} is outside the aux buffers ({aux_items} rows)")
        segments.append(pages_segment(i, r.row, r.prefix_len, r.prompt_len, ps, side.kv.num_pages, validate))
        for c, comp in enumerate(side.state):
            if rules_of(comp.kind).map_by_row and not 0 <= r.row < comp.slot_map.shape[0]:
                raise InputError(r.request, f"{comp.name}: row {r.row} is outside the Mamba map")
            segments.append(component_segment(i, c, comp, ps, r.row, r.prompt_len, validate, r.prefix_len))
    return segments


def plan_destinations(side: SideMemory, requests: Sequence[PreallocatedRequest], stream: torch.cuda.Stream | None = None,
                      block: int = 1024, validate: bool = True) -> PendingDestinations:
    """Compute and validate every destination list of ``requests`` on the token table's device.

    Errors visible from lengths alone (unaligned prefix, row or range outside the table, aux index
    outside the aux buffers) are raised here; the kernels' findings by :meth:`PendingDestinations.result`.
    """
    if side.req_to_token is None:
        raise InputError(None, "the decode side needs its token table (req_to_token)")
    check_token_table(side.req_to_token)
    table = side.req_to_token
    device = table.device if isinstance(table, torch.Tensor) else torch.device("cpu")
    table = as_device_tensor(table, device, "req_to_token")
    require_same_device(side, device)
    require_runnable(device.type)
    if table.dtype != torch.int32 or table.dim() != 2:
        raise InputError(None, f"req_to_token must be a 2-D int32 tensor, got {table.dtype} {tuple(table.shape)}")
    segments = request_segments(side, requests, validate)
    requests = tuple(requests)
    maps = {c: as_device_tensor(comp.slot_map, device, f"slot_map of component {comp.name}", torch.int64)
            for c, comp in enumerate(side.state) if comp.slot_map is not None}
    if device.type == "cuda":
        stream = stream or torch.cuda.current_stream(device)
        with torch.cuda.stream(stream):
            return _launch(side, requests, segments, maps, table, block, stream)
    return _launch(side, requests, segments, maps, table, block, None)


def _launch(side, requests, segments, maps, table, block, stream) -> PendingDestinations:
    device = table.device
    pk = Packer()
    job = ListJob(SegmentTable.from_segments(segments), maps, pk, block)
    staging = pk.ship(device)
    ids, errors, invariant = job.launch(table)
    packed = torch.cat([ids[: job.total], errors, invariant])  # one device-to-host copy
    landing = host_empty(packed.numel(), torch.int64, device)
    landing.copy_(packed, non_blocking=True)
    e0 = job.total + errors.numel()
    host = {"ids": landing[: job.total], "errors": landing[job.total : e0], "invariant": landing[e0:]}
    event = None
    if stream is not None:
        event = torch.cuda.Event()
        event.record(stream)
    return PendingDestinations(event, side, requests, segments, job.seg_off, host,
                               [staging, pk.device_buffer, packed])
