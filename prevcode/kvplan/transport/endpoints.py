"""The two ends of a prefill-to-decode hand-off: registration, destination lists, bytes, completion.

The decode side (:class:`DecodeEndpoint`) registers its pools with the engine and publishes its
layout, then, per request, its destination lists (SGLang's wire format); it tracks completion
from the engine's notifications and the control channel. The prefill side (:class:`PrefillEndpoint`)
pairs the published layout with its own, plans each batch with kvplan and moves it through the
engine, directly (one engine write per section, with a notification), through NIXL prepared
descriptor lists (int32 indices per section, lists made once per peer) or staged (gathered into a
registered staging buffer, one engine write per wave of transfers, scattered by the receiver).

A dead peer, an engine error or a deadline marks the affected requests failed on both sides with
the reason; no section of a failed write is reported as delivered.

Example (decode process)::

    decode = DecodeEndpoint(side, make_engine("nixl", "decode"), ControlChannel())
    decode.register()
    decode.publish([PreallocatedRequest("r1", row=1, prompt_len=4096)], timeout=30)
    states = decode.wait()                          # {"r1": "complete"} or "failed"

Example (prefill process)::

    prefill = PrefillEndpoint(side, make_engine("nixl", "prefill"), ControlChannel(port))
    prefill.accept(timeout=30)
    lists = prefill.receive_requests(1, timeout=30)
    result = prefill.send([prefill.transfer(Chunk("r1", src_row=4, start=0, fill_len=4097, prompt_len=4096,
                                                     last=True, aux_src=4))])
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import LayoutError, PlanError
from ..planner import gpu
from ..planner.destinations import PreallocatedRequest, decode_message, plan_destinations
from ..planner.model import Batch, Policy, SideMemory, Transfer
from ..planner.pairing import pair_sides
from ..planner.plan import AUX_ROLE, KV_ROLE, Plan, Section
from ..planner.prepared import PreparedIndices, prepared_slots
from ..planner.reference import DestinationLists
from .completion import CompletionTracker, SectionNote, decode_notification, encode_notification
from .control import ControlChannel, ControlTimeout
from .engines import Engine, TransferError
from .local import as_device_descriptors, gather, plan_alignment, scatter, staging_offsets, warm_up
from .registration import describe_side, side_from_description

__all__ = ["Chunk", "DecodeEndpoint", "PrefillEndpoint"]

log = logging.getLogger("kvplan")

_STAGED_NOTE = b"null"  # engine notification of a staged region: the control message carries the sections


def _regions(side: SideMemory) -> list[tuple[int, int]]:
    entries = list(side.kv.entries) + [e for c in side.state for e in c.entries] + list(side.aux)
    return [(e.base_ptr, e.item_len * e.num_items) for e in entries]


def _device_of(side: SideMemory) -> torch.device:
    table = side.req_to_token
    return table.device if isinstance(table, torch.Tensor) else torch.device("cpu")


class DecodeEndpoint:
    """The receiving side: registers, publishes destination lists, scatters staged regions, tracks completion."""

    def __init__(self, side: SideMemory, engine: Engine, channel: ControlChannel, staging: torch.Tensor | None = None):
        self.side, self.engine, self.channel, self.staging = side, engine, channel, staging
        self.tracker = CompletionTracker()
        self.engine.register(_regions(side) + ([(staging.data_ptr(), staging.numel())] if staging is not None else []))
        if staging is not None:
            warm_up(staging)

    def register(self, timeout: float = 60.0) -> None:
        """Publish this side's layout, engine metadata and staging buffer; waits up to ``timeout``
        seconds for the prefill side to connect."""
        header = {"side": describe_side(self.side),
                  "staging": [self.staging.data_ptr(), self.staging.numel()] if self.staging is not None else None}
        self.channel.send("register", header, self.engine.metadata(), timeout=timeout)

    def publish(self, requests: Sequence[PreallocatedRequest], timeout: float) -> None:
        """Compute, validate and send every request's destination lists; start tracking them."""
        pending = plan_destinations(self.side, requests)
        published = pending.result()
        deadline = time.monotonic() + timeout
        for p in published:
            self.tracker.expect(p.expectation(), deadline)
        for r, message in zip(requests, pending.messages()):
            try:
                self.channel.send("request", {"request": r.request, "prompt_len": r.prompt_len,
                                              "prefix_len": r.prefix_len}, message,
                                  timeout=max(0.0, deadline - time.monotonic()))
            except ControlTimeout as err:
                self.tracker.fail(r.request, f"its destination lists could not be published: {err}")

    def poll(self) -> None:
        """Take in what has arrived: engine notifications, staged regions, failures; apply deadlines."""
        for raw in self.engine.notifications():
            if raw != _STAGED_NOTE:
                self.tracker.on_section(decode_notification(raw))
        while (msg := self.channel.try_recv()) is not None:
            kind, header, frames = msg
            if kind == "staged":
                self._scatter(header, frames[0])
            elif kind == "wave":
                self.channel.send("wave-done", {})
            elif kind == "failed":
                self.tracker.fail(header["request"], f"the prefill side reports: {header['reason']}")
            elif kind == "refused":
                self.tracker.fail_pending(f"the prefill side refused the pairing: {header['reason']}")
        self.tracker.check_deadlines(time.monotonic())

    def wait(self, poll_interval: float = 0.001) -> dict[Any, str]:
        """Poll until every request is complete or failed (each has its deadline); return the states."""
        while True:
            self.poll()
            if self.tracker.settled():
                return self.tracker.states()
            time.sleep(poll_interval)

    def _scatter(self, header: dict[str, Any], table: bytes) -> None:
        dst_and_size = np.frombuffer(table, dtype=np.uint64).reshape(-1, 2)
        descs = np.zeros((len(dst_and_size), 3), dtype=np.uint64)
        descs[:, 1:] = dst_and_size
        device = self.staging.device
        device_descs = as_device_descriptors(descs, device)
        offsets, _ = staging_offsets(device_descs)
        scatter(device_descs, offsets + int(header["staging_lo"]), self.staging, int(header["alignment"]))
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        for request, role, name, count in header["sections"]:
            self.tracker.on_section(SectionNote(request, role, name, count))


@dataclass(frozen=True)
class Chunk:
    """What the prefill scheduler knows about one chunk of a request it is about to send."""

    request: Any
    src_row: int
    start: int
    fill_len: int
    prompt_len: int
    last: bool
    aux_src: int = 0


class PrefillEndpoint:
    """The sending side: pairs with the published layout, plans batches, moves them, reports failures."""

    def __init__(self, side: SideMemory, engine: Engine, channel: ControlChannel, staging: torch.Tensor | None = None,
                 policy: Policy = Policy.STRICT):
        self.side, self.engine, self.channel, self.staging, self.policy = side, engine, channel, staging, policy
        self.engine.register(_regions(side) + ([(staging.data_ptr(), staging.numel())] if staging is not None else []))
        if staging is not None:
            warm_up(staging)
        self.peer: str | None = None
        self.peer_side: SideMemory | None = None
        self.peer_staging: tuple[int, int] | None = None
        self.lists: dict[Any, tuple[DestinationLists, int, int]] = {}
        self._prepared = False

    def accept(self, timeout: float) -> None:
        """Receive the decode side's registration and pair with it (refusing it with a reason if it cannot)."""
        kind, header, frames = self.channel.recv(time.monotonic() + timeout)
        if kind != "register":
            raise LayoutError(f"expected a registration, got {kind!r}")
        peer_side = side_from_description(header["side"])
        try:
            pair_sides(self.side, peer_side)
        except LayoutError as err:
            self.channel.send("refused", {"reason": str(err)})
            raise
        self.peer_side = peer_side
        self.peer_staging = tuple(header["staging"]) if header["staging"] else None
        self.peer = self.engine.connect(frames[0])

    def receive_requests(self, count: int, timeout: float) -> None:
        """Receive ``count`` requests' destination lists (wire messages) from the decode side."""
        deadline = time.monotonic() + timeout
        for _ in range(count):
            kind, header, frames = self.channel.recv(deadline)
            if kind != "request":
                raise LayoutError(f"expected destination lists, got {kind!r}")
            lists, aux = decode_message(frames[0], len(self.peer_side.state))
            self.lists[header["request"]] = (lists, aux, header["prefix_len"])

    def transfer(self, chunk: Chunk) -> Transfer:
        """The :class:`Transfer` of a chunk, with the destination lists its request published."""
        lists, aux_dst, prefix_len = self.lists[chunk.request]
        return Transfer(chunk.request, chunk.src_row, chunk.start, chunk.fill_len, chunk.prompt_len, chunk.last,
                        lists.pages, prefix_len, chunk.aux_src, aux_dst, lists.state)

    def send(self, transfers: Sequence[Transfer], mode: str = "direct", timeout: float = 30.0) -> dict[Any, str | None]:
        """Plan and move a batch; returns, per request, ``None`` when sent or the failure reason.

        A batch that does not plan (bad input) is refused whole: nothing is sent, every request of
        it is reported failed to the decode side, and the :class:`~kvplan.errors.PlanError` is raised.
        """
        if mode not in ("direct", "staged", "prepared"):
            raise ValueError(f"mode must be 'direct', 'staged' or 'prepared', got {mode!r}")
        batch = Batch(self.side, (self.peer_side,), tuple(transfers), self.policy)
        try:
            pending = gpu.plan(batch, prepared=mode == "prepared")
            plan = pending.result()
        except PlanError as err:
            for request in {t.request for t in transfers}:
                self._report(request, f"batch refused: {err}")
            raise
        deadline = time.monotonic() + timeout
        if mode == "direct":
            return self._send_direct(plan, deadline)
        if mode == "prepared":
            return self._send_prepared(plan, pending.prepared_indices(), deadline)
        return self._send_staged(plan, pending.device_descriptors(), plan_alignment(batch), deadline)

    def _report(self, request: Any, reason: str) -> None:
        log.warning("request %r failed: %s", request, reason)
        try:
            self.channel.send("failed", {"request": request, "reason": reason}, timeout=0.5)
        except Exception as err:  # noqa: BLE001 - the peer may be gone; the failure is still ours to report
            log.warning("could not tell the decode side that %r failed: %s", request, err)

    def _send_direct(self, plan: Plan, deadline: float) -> dict[Any, str | None]:
        descs, _ = plan.descriptors()
        result: dict[Any, str | None] = {t.request: None for t in plan.transfers}
        for section in plan.sections():
            if result[section.request] is not None:
                continue
            try:
                self.engine.write(self.peer, descs[section.lo : section.hi], encode_notification(section), deadline)
            except TransferError as err:
                result[section.request] = str(err)
                self._report(section.request, str(err))
        return result

    def _prepare(self) -> None:
        """NIXL prepared lists for every role, made once per peer (entry x slot descriptors)."""
        if not hasattr(self.engine, "prepare"):
            raise LayoutError(f"the {type(self.engine).__name__} has no prepared descriptor lists; use direct mode")
        pairing = pair_sides(self.side, self.peer_side)
        tables = {KV_ROLE: (pairing.kv_src, pairing.kv_dst), AUX_ROLE: (pairing.aux_src, pairing.aux_dst)}
        tables.update({c: t for c, t in enumerate(zip(pairing.state_src, pairing.state_dst))})
        for role, (entries, src_slots, dst_slots) in prepared_slots(self.side, self.peer_side).items():
            src_t, dst_t = tables[role]
            items = lambda t, slots: np.concatenate([t, np.full((len(t), 1), slots, np.uint64)], axis=1)  # noqa: E731
            self.engine.prepare(self.peer, role, items(src_t, src_slots), items(dst_t, dst_slots))
        self._prepared = True

    def _send_prepared(self, plan: Plan, indices: PreparedIndices, deadline: float) -> dict[Any, str | None]:
        if not self._prepared:
            self._prepare()
        result: dict[Any, str | None] = {t.request: None for t in plan.transfers}
        names = {KV_ROLE: "kv", AUX_ROLE: "aux", **{c: comp.name for c, comp in enumerate(self.side.state)}}
        for s, (role, owner) in enumerate(zip(indices.section_role.tolist(), indices.section_transfer.tolist())):
            lo, hi = int(indices.section_offsets[s]), int(indices.section_offsets[s + 1])
            request = plan.transfers[owner].request
            if lo == hi or result[request] is not None:
                continue
            count = len(plan.transfers[owner].dst_pages) if role == KV_ROLE else 1
            note = encode_notification(Section(owner, request, role, names[role], lo, hi, count))
            try:
                self.engine.write_prepared(self.peer, role, indices.src[lo:hi], indices.dst[lo:hi], note, deadline)
            except TransferError as err:
                result[request] = str(err)
                self._report(request, str(err))
        return result

    def _send_staged(self, plan: Plan, device_descs: torch.Tensor, alignment: int, deadline: float) -> dict[Any, str | None]:
        """Waves of whole transfers that fit both staging buffers: gather a wave, move it with one
        engine write, tell the receiver what to scatter, and wait for its acknowledgement before
        reusing the buffers."""
        if self.staging is None or self.peer_staging is None:
            raise LayoutError("staged mode needs a registered staging buffer on both sides")
        descs, offsets = plan.descriptors()
        byte_starts = np.concatenate([[0], np.cumsum(descs[:, 2], dtype=np.uint64)]).astype(np.int64)
        capacity = min(self.staging.numel(), self.peer_staging[1])
        sections = plan.sections()
        result: dict[Any, str | None] = {t.request: None for t in plan.transfers}
        wave: list[int] = []
        for i, t in enumerate(plan.transfers):
            size = int(byte_starts[offsets[i + 1]] - byte_starts[offsets[i]])
            if size > capacity:  # a wave is a contiguous range of transfers: close it before this one
                if wave:
                    self._staged_wave(plan, wave, descs, offsets, byte_starts, device_descs, sections, alignment,
                                      result, deadline)
                    wave = []
                reason = f"this transfer needs {size} staging bytes; the staging buffers hold {capacity}"
                result[t.request] = reason
                self._report(t.request, reason)
                continue
            wave_bytes = int(byte_starts[offsets[wave[-1] + 1]] - byte_starts[offsets[wave[0]]]) if wave else 0
            if wave and wave_bytes + size > capacity:
                self._staged_wave(plan, wave, descs, offsets, byte_starts, device_descs, sections, alignment, result,
                                  deadline)
                wave = []
            wave.append(i)
        if wave:
            self._staged_wave(plan, wave, descs, offsets, byte_starts, device_descs, sections, alignment, result, deadline)
        return result

    def _staged_wave(self, plan, wave, descs, offsets, byte_starts, device_descs, sections, alignment, result,
                     deadline) -> None:
        d_lo, d_hi = int(offsets[wave[0]]), int(offsets[wave[-1] + 1])
        base = int(byte_starts[d_lo])
        wave_descs = device_descs[d_lo:d_hi]
        gather(wave_descs, staging_offsets(wave_descs)[0], self.staging, alignment)
        if self.staging.is_cuda:
            torch.cuda.current_stream(self.staging.device).synchronize()
        size = int(byte_starts[d_hi]) - base
        requests = list(dict.fromkeys(plan.transfers[i].request for i in wave))
        if size:
            region = np.array([[self.staging.data_ptr(), self.peer_staging[0], size]], dtype=np.uint64)
            notes = [[s.request, s.role, s.name, s.count] for s in sections if wave[0] <= s.transfer <= wave[-1]]
            try:  # one engine write moves the whole wave; the receiver scatters it with the wave's descriptors
                self.engine.write(self.peer, region, _STAGED_NOTE, deadline)
                self.channel.send("staged", {"sections": notes, "staging_lo": 0, "alignment": alignment},
                                  np.ascontiguousarray(descs[d_lo:d_hi, 1:]).tobytes())
            except (TransferError, ControlTimeout) as err:
                for request in requests:
                    if result[request] is None:
                        result[request] = str(err)
                        self._report(request, str(err))
                return
        try:  # the receiver has scattered this wave once it acknowledges; then the buffers are free again
            self.channel.send("wave", {}, timeout=max(0.0, deadline - time.monotonic()))
            kind, _, _ = self.channel.recv(deadline)
            if kind != "wave-done":
                raise ControlTimeout(f"expected the receiver's acknowledgement, got {kind!r}")
        except ControlTimeout as err:
            for i in wave:
                request = plan.transfers[i].request
                if result[request] is None:
                    result[request] = f"the receiver did not acknowledge its staged wave: {err}"
                    self._report(request, result[request])
