"""The sending side of a hand-off: pairing, planning, and moving a batch through the engine.

:class:`PrefillEndpoint` pairs with the layout a decode side published, plans each batch with
kvplan and moves it:

* ``direct``: every section (a transfer's KV, each state component, aux) is posted as one engine
  write with its notification, all of them before waiting for any;
* ``prepared``: the same through NIXL prepared descriptor lists, made once per peer, with the
  planner's int32 indices;
* ``staged``: waves of descriptors gathered into a ring of staging slots. The gather of one wave,
  the engine write of another and the receiver's scatter of a third overlap: the sender needs a
  slot's credit (returned by the receiver after its scatter) and the end of its own last write from
  that slot, nothing else. The run is announced on the control channel ahead of its bytes: by its
  chunks alone where the receiver can plan its own scatter (:mod:`.receiver_plan`; the chunks as soon
  as this side's plan is launched, the waves once it is seen), else with every wave's destination
  table; the engine's notification, carrying the wave id, says a wave has landed. The first wave's
  gather is queued right behind the plan (:mod:`.ahead`).
* ``auto`` (the default): staged when both sides have staging buffers on a GPU and the batch has at least
  64 descriptors of at most 256 KiB on average, else direct. (TensorRT-LLM gates at 1024 and 16 KiB;
  on an H200 through CUDA IPC a direct write costs ~10 us per descriptor, so staging wins far
  beyond 16 KiB: see benchmarks/RESULTS.md.)

A write that misses its deadline is aborted, and reported failed only once it has ended.

Example::

    prefill = PrefillEndpoint(side, make_engine("nixl", "prefill"), ControlChannel(port, host="127.0.0.1"))
    prefill.accept(timeout=30)
    prefill.receive_requests(1, timeout=30)
    result = prefill.send([prefill.transfer(Chunk("r1", src_row=4, start=0, fill_len=4097, prompt_len=4096,
                                                     last=True, aux_src=4))])     # {"r1": None} when sent
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import KvplanError, LayoutError, PlanError
from ..planner import gpu
from ..planner.destinations import decode_message, list_entries
from ..kernels.copy import GATHER
from ..planner.model import Batch, Policy, SideMemory, Transfer
from ..planner.pairing import pair_sides
from ..planner.device import Planner
from ..planner.isolate import plan_each
from ..planner.layer_groups import group_sections
from ..planner.plan import AUX_ROLE, KV_ROLE, DestinationLists, Section
from ..planner.prepared import PreparedIndices, prepared_slots
from .ahead import AheadGatherer, GatherAhead
from .completion import encode_notification
from .control import ControlChannel, ControlTimeout, named_request
from .copy_graphs import CopyGraphs, copy_graphs_enabled
from .decode import engine_regions
from .engines import Engine, Handle, is_unsafe, wait_all
from .integrity import RunningSums, transfer_sums
from .local import gather, plan_alignment, typical_sizes, warm_up
from .pause import Pause
from .readiness import LayerStreaming
from .streams import transport_stream
from .receiver_plan import planned_run_chunks, planned_run_message, planned_run_waves, receiver_can_plan
from .registration import describe_side, side_from_description, with_model_heads
from .waves import Wave, decode_credit, one_wave, plan_waves, run_message, staging_ring, wave_note

__all__ = ["Chunk", "MODES", "Peer", "PrefillEndpoint"]

log = logging.getLogger("kvplan")

MODES = ("auto", "direct", "prepared", "staged")
ACK_S = 0.5  # how long an abort's acknowledgement may wait on a full control socket
AUTO_MIN_DESCS, AUTO_MAX_AVG_BYTES = 64, 256 << 10
MAX_PUBLISHERS = 1024  # decode endpoints one request may be spread over (a larger count in a message is ignored)


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


@dataclass
class Peer:
    """One decode endpoint this prefill endpoint sends to: its channel, engine name, layout,
    staging buffer and the destination lists it published."""

    channel: ControlChannel
    name: str | None = None
    side: SideMemory | None = None
    staging: tuple[int, int] | None = None
    lists: dict[Any, tuple[DestinationLists, int, int]] = field(default_factory=dict)
    backlog: deque = field(default_factory=deque)  # messages that arrived while a send read credits
    prepared: bool = False
    plannable: bool = False  # its staged runs may go without tables (receiver_plan.receiver_can_plan)
    planning: set = field(default_factory=set)  # requests it published with a row: it can plan their scatter
    index_there: int | None = None  # how that endpoint knows this sender, where it has several (notifications name it)
    credits_by_engine: bool = False  # it returns staged slots' credits as engine notifications (Capabilities.notifies)
    notified: bool = True  # it learns of a write from the write's notification (else from another message)
    dropped: bool = False  # it is gone and what it published was dropped (:meth:`PrefillEndpoint._drop`)
    integrity: bool = False  # it asked for each request's checksum (.integrity)

    def notification(self, section: Any) -> bytes:
        """A direct or prepared write's notification of ``section``, naming this sender where the
        endpoint has several; empty for a peer that takes none (the engine then notifies nothing)."""
        return encode_notification(section, self.index_there) if self.notified else b""

    def recv(self, deadline: float) -> tuple[str, dict[str, Any], list[bytes]]:
        return self.backlog.popleft() if self.backlog else self.channel.recv(deadline)


def _staging_share(value: Any) -> tuple[int, int] | None:
    """A registration's staging share ``[address, bytes]`` (``None``: it has no staging buffer)."""
    if not value:
        return None
    if not isinstance(value, list) or len(value) != 2 or not all(isinstance(x, int) and x >= 0 for x in value) \
            or value[0] + value[1] >= 1 << 64:
        raise LayoutError(f"the registration's staging share is {value!r}, not [address, bytes]")
    return value[0], value[1]


class PrefillEndpoint:
    """The sending side (see the module docstring).

    ``channels``: one control channel per decode endpoint (peer ``k`` is ``channels[k]``); a batch's
    transfers name their peer in ``Transfer.dest`` (:meth:`transfer` sets it), so one batch can fan
    out to several decode endpoints. ``slots`` is the staging ring's length. ``receiver_plans``: a
    staged run whose receiver can plan its own scatter (:mod:`.receiver_plan`) is announced by its
    chunks alone; ``False`` always sends the destination table. ``compat``: where set, a decode
    endpoint whose registration does not carry the same word is refused (what the layouts cannot show,
    such as the order of a block's bytes).
    """

    def __init__(self, side: SideMemory, engine: Engine, channels: ControlChannel | Sequence[ControlChannel],
                 staging: torch.Tensor | None = None, policy: Policy = Policy.STRICT, slots: int = 4,
                 refuse: str = "batch", receiver_plans: bool = True, compat: str | None = None):
        if refuse not in ("batch", "request"):
            raise ValueError(f"refuse must be 'batch' or 'request', got {refuse!r}")
        self.side, self.engine, self.staging, self.policy, self.refuse = side, engine, staging, policy, refuse
        self.receiver_plans = receiver_plans
        self.compat = compat  # a decode endpoint pairs only with the same word (DecodeEndpoint's ``compat``)
        self.peers = [Peer(c) for c in (channels if isinstance(channels, (list, tuple)) else [channels])]
        self.slots = slots
        self.engine.register(engine_regions(side) + ([(staging.data_ptr(), staging.numel())] if staging is not None else []))
        if staging is not None and staging.is_cuda:  # (the interpreter compiles nothing: nothing to warm off a GPU)
            warm_up(staging)
        # high priority: a wave's gather is short and holds up its write; it must not queue behind the forward
        # pass that streaming in layer groups overlaps (docs/layerwise.md)
        self._stream = transport_stream(staging.device) if staging is not None and staging.is_cuda else None
        # a staged run's first wave is gathered behind its plan, before the host has seen the plan
        self._ahead = AheadGatherer(staging, self._stream, CopyGraphs(transport_stream(staging.device))
                                    if copy_graphs_enabled() else None) if self._stream is not None else None
        self._plan_stream: torch.cuda.Stream | None = None  # a streamed send's (made on the first)
        self._next_wave = 0
        self._next_run = 0  # ids of runs announced by their chunks ahead of their waves
        self.id = uuid.uuid4().hex[:12]  # names this sender's waves on receivers that have several senders
        # (peer, request, reason) of requests a decode endpoint aborted (its lists are dropped); the caller drains it
        self.aborted: list[tuple[int, Any, str]] = []
        # (peer, request) of aborts of requests it holds no lists of; the last 4096 (a caller that never
        # drains it keeps no more)
        self.given_up: deque[tuple[int, Any]] = deque(maxlen=4096)
        # per request, how many decode endpoints publish it here, where they said (a decode of a larger TP
        # size spreads each request over several ranks this one serves: it may go only once all have published)
        self.publishers: dict[Any, int] = {}
        # requests with a write that could not be ended (wait_all's "unsafe"): their aborts are not fenced
        self.unsafe: set[Any] = set()
        self.last_mode: str | None = None  # the mode the last send used (what ``auto`` chose)
        self.last_announcement: str | None = None  # how its last staged run was announced: "planned" or "table"
        self.waves_ahead = 0  # staged waves gathered ahead of their layer group's mark, over this endpoint's life
        self.first_waves_ahead = 0  # staged runs whose first wave was gathered behind the plan (.ahead)
        self._planners: dict[bool, Planner] = {}  # by prepared or not
        self._alignments: tuple[tuple[SideMemory, ...], int] | None = None  # the last sides' copy word
        self._times: list[tuple[str, float]] = []
        self._sums = RunningSums()  # (peer, request) -> its chunks' checksum so far, on the device (.integrity)
        self._warm_shape: tuple[int, int] | None = None  # warm_up's batch bound, applied to peers as they pair
        self._touched: set[int] = set()  # peers whose staging share the warm-up has written (its runs may be there now)

    # the first peer, for the common one-to-one pairing
    channel = property(lambda self: self.peers[0].channel)
    peer = property(lambda self: self.peers[0].name)
    peer_side = property(lambda self: self.peers[0].side)
    peer_staging = property(lambda self: self.peers[0].staging)
    lists = property(lambda self: self.peers[0].lists)

    @property
    def gathers_replayed(self) -> int:
        """First waves gathered behind their plans as CUDA graph replays (.copy_graphs), over this endpoint's life."""
        graphs = self._ahead.graphs if self._ahead is not None else None
        return graphs.replays if graphs is not None else 0

    def accept(self, timeout: float) -> None:
        """Receive every decode endpoint's registration and pair with it (refusing one that cannot
        pair, with the reason, and raising)."""
        deadline = time.monotonic() + timeout
        for k, peer in enumerate(self.peers):
            kind, header, frames = peer.recv(deadline)
            while kind == "wave-done":  # a receiver that outlived an earlier sender may still answer its waves
                kind, header, frames = peer.recv(deadline)
            if kind != "register":
                raise LayoutError(f"expected a registration, got {kind!r}")
            self._on_register(k, header, frames)

    def add_peer(self, channel: ControlChannel, timeout: float) -> int:
        """Take one more decode endpoint, on ``channel``: wait for its registration and pair with it
        (as :meth:`accept`); its index. On a timeout or a refused pairing the channel is closed, it
        is not added, and the error is raised."""
        self.peers.append(Peer(channel))
        k = len(self.peers) - 1
        try:
            kind, header, frames = channel.recv(time.monotonic() + timeout)
            if kind != "register":
                raise LayoutError(f"expected a registration, got {kind!r}")
            self._on_register(k, header, frames)
        except BaseException:
            self.peers.pop()
            channel.close()
            raise
        return k

    def warm_up(self, max_transfers: int = 16, max_prompt_len: int = 8192, timeout: float = 10.0) -> dict[str, float]:
        """Do at start-up what a first batch would otherwise pay for (issue 37: 250-760 ms against a
        steady 2-5 ms), for every decode endpoint paired now and, from then on, for each one as it
        pairs: the device planner made and every bucket of batches of up to ``max_transfers`` transfers
        of requests of up to ``max_prompt_len`` tokens captured
        (:meth:`~kvplan.planner.device.Planner.warm_up`), the gather kernels compiled for the pairing's
        launch shapes, and the engine's connection to each decode's staging buffer opened by a 16-byte
        write into its share (nothing of a batch is there before the first run). Call it after
        :meth:`accept` (the decode side calls :meth:`DecodeEndpoint.warm_up` meanwhile). Returns the
        seconds each step took.

        Example::

            prefill.accept(timeout=30)
            prefill.warm_up(max_transfers=64, max_prompt_len=8192)
        """
        if max_transfers < 1 or max_prompt_len < 1:
            raise ValueError(f"warm_up needs at least one transfer of one token, got {max_transfers} x {max_prompt_len}")
        self._warm_shape = (max_transfers, max_prompt_len)
        return self._warm_peers(timeout)

    def _warm_peers(self, timeout: float) -> dict[str, float]:
        """:meth:`warm_up`'s steps for the peers paired now (none while any is still unpaired)."""
        took: dict[str, float] = {}
        if self._warm_shape is None or not self.peers or any(p.side is None for p in self.peers):
            return took
        max_transfers, max_prompt_len = self._warm_shape
        sides = tuple(p.side for p in self.peers)
        start = time.perf_counter()
        if self.staging is not None and self.staging.is_cuda:
            warm_up(self.staging, plan_alignment(Batch(self.side, sides, ())), typical_sizes(self.side), kinds=(GATHER,))
        took["kernels"] = time.perf_counter() - start
        start = time.perf_counter()
        self._planner(prepared=False).warm_up(max_transfers, max(list_entries(side, max_prompt_len) for side in sides))
        took["planners"] = time.perf_counter() - start
        start = time.perf_counter()
        self._touch_peers(time.monotonic() + timeout)
        took["connections"] = time.perf_counter() - start
        log.info("prefill endpoint warmed up for %d decode endpoints: %s", len(self.peers),
                 ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in took.items()))
        return took

    def _touch_peers(self, deadline: float) -> None:
        """Open the engine's connection to each decode paired since the last warm-up: 16 bytes of this
        side's staging buffer written to its share's start (no run has gone there yet; no notification)."""
        if self.staging is None or self.staging.numel() < 16:
            return
        handles = {}
        for k, p in enumerate(self.peers):
            if k not in self._touched and p.staging is not None and p.staging[1] >= 16 and p.name is not None \
                    and not p.dropped:
                self._touched.add(k)
                descs = np.array([[self.staging.data_ptr(), p.staging[0], 16]], dtype=np.uint64)
                handles[self.engine.post(p.name, descs, b"")] = k
        for handle, reason in wait_all(self.engine, list(handles), deadline).items():
            if reason is not None:
                log.warning("warm-up: the write to decode endpoint %d's staging buffer failed: %s", handles[handle], reason)

    def published_by_all(self, request: Any) -> bool:
        """Whether every decode endpoint that publishes ``request`` here has (:attr:`publishers`; one where
        none said otherwise)."""
        return sum(request in p.lists for p in self.peers) >= self.publishers.get(request, 1)

    def receive_requests(self, count: int, timeout: float, peer: int = 0) -> None:
        """Receive ``count`` requests' destination lists (wire messages) from decode endpoint ``peer``."""
        deadline = time.monotonic() + timeout
        p = self.peers[peer]
        for _ in range(count):
            kind, header, frames = p.recv(deadline)
            if kind != "request":
                raise LayoutError(f"expected destination lists, got {kind!r}")
            self._on_request(peer, header, frames)

    def progress(self) -> list[tuple[int, Any]]:
        """Take in, without blocking, whatever the decode endpoints have sent: registrations (paired
        as :meth:`accept` pairs them) and destination lists. Returns the ``(peer, request)`` pairs
        whose lists arrived; a registration that cannot pair is refused and raises ``LayoutError``."""
        arrived = []
        for k, p in enumerate(self.peers):
            while (msg := (p.backlog.popleft() if p.backlog else p.channel.try_recv())) is not None:
                kind, header, frames = msg
                if kind == "register":
                    self._on_register(k, header, frames)
                elif kind == "request" and p.side is not None:
                    if (request := self._on_request(k, header, frames)) is not None:
                        arrived.append((k, request))
                elif kind == "abort" and (request := named_request(header)) is not None:
                    self._on_abort(k, request, str(header.get("reason") or "aborted"))
            if p.side is not None and not p.dropped and p.channel.peer_gone():
                self._drop(k)
        return arrived

    def _drop(self, k: int) -> None:
        """Decode endpoint ``k`` is gone: forget what it published and what the engine keeps for it
        (issue 38: a prefill that outlived many decode endpoints kept every one's lists and NIXL
        agent). Its index stays; a restarted endpoint on the same channel registers and pairs again."""
        p = self.peers[k]
        log.warning("decode endpoint %d is gone: dropping its %d requests' lists and its engine connection",
                    k, len(p.lists))
        if p.name is not None:
            self.engine.disconnect(p.name)
        p.lists.clear()
        p.planning.clear()
        p.backlog.clear()
        self._sums.drop([key for key in self._sums.keys() if key[0] == k])
        p.name, p.prepared, p.dropped = None, False, True  # (its layout stays: the planner pairs every peer)

    def _on_abort(self, k: int, request: Any, reason: str) -> None:
        """A decode endpoint aborted ``request``: nothing more of it goes there, and it is told so at
        once ("abort-ack"). The acknowledgement is its fence: ``send`` returns only once every write it
        posted has ended, so when this runs no write into the request's pages is in flight, unless one
        could not be ended (``unsafe``, :func:`~kvplan.transport.engines.base.wait_all`): then the
        acknowledgement says ``fenced: false`` and the decode side must keep the pages out of use.
        One it holds no lists of goes to :attr:`given_up` instead: its decode gave it up before it had
        pages, or after it was sent (the vLLM connector frees the prefill's blocks of the first at once,
        rather than at its deadline)."""
        if request in self.peers[k].lists:
            self.forget([request], peer=k)
            self.aborted.append((k, request, reason))
        else:
            self.given_up.append((k, request))
        try:
            self.peers[k].channel.send("abort-ack", {"request": request, "fenced": request not in self.unsafe},
                                       timeout=ACK_S)
        except KvplanError as err:  # the decode side is gone or stuck: it cannot be told; its pages are its own
            log.warning("request %r: the abort could not be acknowledged: %s", request, err)

    def _on_register(self, k: int, header: dict[str, Any], frames: list[bytes]) -> None:
        """Pair with decode endpoint ``k`` from its registration; one that is malformed or cannot pair
        is refused (told so, with the reason) and raises :class:`~kvplan.errors.LayoutError`."""
        peer = self.peers[k]
        try:
            if self.compat is not None and header.get("compat") != self.compat:
                raise LayoutError(f"the decode side's KV bytes are {header.get('compat')!r}, this side's "
                                  f"{self.compat!r}: they would land scrambled")
            peer_side = with_model_heads(side_from_description(header["side"]), self.side.kv.num_kv_heads)
            pair_sides(self.side, peer_side)
            staging = _staging_share(header.get("staging"))
            index_there = header.get("peer")
            if index_there is not None and (not isinstance(index_there, int) or index_there < 0):
                raise LayoutError(f"the registration names this sender by {index_there!r}, not an index")
            if not frames:
                raise LayoutError("the registration carries no engine metadata")
        except (LayoutError, KeyError, TypeError, ValueError, OverflowError) as err:
            why = str(err) if isinstance(err, LayoutError) else f"a malformed registration ({type(err).__name__}: {err})"
            peer.channel.send("refused", {"reason": why})
            raise LayoutError(f"decode endpoint {k}: {why}") from err
        peer.side, peer.dropped = peer_side, False
        self._touched.discard(k)  # (a decode that registers again is a new one: nothing of this side's is there)
        peer.plannable = receiver_can_plan(self.side, peer_side, self.policy)
        peer.staging = staging
        peer.index_there = index_there
        peer.integrity = header.get("integrity") is True
        peer.name = self.engine.connect(frames[0])
        # this side's layout: a decode rank that gathers from several source ranks checks their ranks with it
        # (its engine's name: the receiver checks that a section's notification comes from the sender of its request)
        paired: dict[str, Any] = {"from": self.id, "side": describe_side(self.side), "engine": self.engine.name}
        peer.credits_by_engine = bool(header.get("notifies")) and self.engine.capabilities.notifies
        if peer.credits_by_engine:  # its credits come back through the engine, to this side's metadata
            paired["credits"] = "engine"
            peer.channel.send("paired", paired, self.engine.metadata())
        else:
            peer.channel.send("paired", paired)
        self._warm_peers(timeout=ACK_S * 4)  # (after warm_up: each peer that pairs later is warmed as it pairs)

    def _on_request(self, k: int, header: dict[str, Any], frames: list[bytes]) -> Any:
        """Keep a request's destination lists from decode endpoint ``k``; its name, or ``None`` where the
        message is malformed (then the request, if it has a usable name, is answered ``failed``)."""
        p = self.peers[k]
        request = named_request(header)
        try:
            if request is None:
                raise ValueError(f"it names no request ({header.get('request')!r})")
            prefix_len = header["prefix_len"]
            if not isinstance(prefix_len, int) or prefix_len < 0:
                raise ValueError(f"its prefix length is {prefix_len!r}")
            lists, aux = decode_message(frames[0], len(p.side.state))
        except (KvplanError, KeyError, IndexError, TypeError, ValueError, OverflowError) as err:
            why = f"its destination lists are malformed ({type(err).__name__}: {err})"
            if request is not None:
                self._report(k, request, why)
            else:
                log.warning("decode endpoint %d sent destination lists this side cannot use: %s", k, why)
            return None
        p.lists[request] = (lists, aux, prefix_len)
        publishers = header.get("publishers")
        if isinstance(publishers, int) and not isinstance(publishers, bool) and 1 < publishers <= MAX_PUBLISHERS:
            self.publishers[request] = publishers  # (a peer that overstates it only delays its own request)
        if header.get("plans"):
            p.planning.add(request)
        return request

    def footprint(self) -> dict[str, int]:
        """How many entries this endpoint's per-request tables hold, over every peer (what ``kvplan
        load`` watches for growth)."""
        return {"lists": sum(len(p.lists) for p in self.peers), "planning": sum(len(p.planning) for p in self.peers),
                "backlog": sum(len(p.backlog) for p in self.peers), "unsafe": len(self.unsafe),
                "aborted": len(self.aborted), "checksums": len(self._sums), "publishers": len(self.publishers)}

    def transfer(self, chunk: Chunk, peer: int = 0) -> Transfer:
        """The :class:`Transfer` of a chunk to decode endpoint ``peer``, with the lists it published."""
        lists, aux_dst, prefix_len = self.peers[peer].lists[chunk.request]
        return Transfer(chunk.request, chunk.src_row, chunk.start, chunk.fill_len, chunk.prompt_len, chunk.last,
                        lists.pages, prefix_len, chunk.aux_src, aux_dst, lists.state, dest=peer)

    def forget(self, requests: Sequence[Any], peer: int | None = None) -> None:
        """Drop the destination lists of finished requests (of one peer, or of all)."""
        for k, p in enumerate(self.peers):
            if peer is not None and k != peer:
                continue
            for r in requests:
                p.lists.pop(r, None)
                p.planning.discard(r)
                self._sums.drop([(k, r)])
        for r in requests:
            if r in self.publishers and not any(r in p.lists for p in self.peers):
                del self.publishers[r]

    def send(self, transfers: Sequence[Transfer], mode: str = "auto", timeout: float = 30.0,
             layers: LayerStreaming | None = None) -> dict[Any, str | None]:
        """Plan and move a batch; returns, per request, ``None`` when sent or the failure reason.

        ``layers``: stream the batch while the forward pass still writes it (docs/layerwise.md). The
        batch is planned at once; each layer group's part of it goes as soon as ``layers.readiness``
        says the group is written: as direct writes, or as a staged run with destination tables
        (``auto`` chooses for the whole batch as it does without streaming; ``prepared`` cannot
        stream). Its sections name their layers. Aux, and components that declare no layers, go
        with the last group. On a GPU the streamed send plans, gathers and scatters on transport
        streams of its own (:mod:`.streams`) that wait only for ``layers.inputs_ready`` (else for
        the current stream as it is at the call), never for the forward pass queued behind.

        A batch that does not plan (bad input) is refused whole: nothing is sent, every request of
        it is reported failed to its decode endpoint, and the :class:`~kvplan.errors.PlanError` is raised.
        With ``refuse="request"`` (set on the endpoint) only the bad requests fail, each with its own
        error, and the rest of the batch is sent.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if layers is not None and mode == "prepared":
            raise ValueError("prepared lists cannot stream in layer groups; use direct, staged or auto")
        if (mode == "prepared" or layers is not None) and any(self.peers[t.dest].integrity for t in transfers):
            raise ValueError("a decode endpoint asked for checksums (integrity=True), which need a plan's descriptors "
                             "and every byte written when it is planned: send direct, staged or auto, without layer "
                             "streaming (kvplan.transport.integrity)")
        with self._streaming(layers):
            return self._send(transfers, mode, timeout, layers)

    def _streaming(self, layers: LayerStreaming | None):
        """Where a send's device work goes: the caller's current stream, or for a streamed send on a
        GPU, this endpoint's planning stream, ordered after ``layers.inputs_ready`` only."""
        table = self.side.req_to_token
        if layers is None or not isinstance(table, torch.Tensor) or not table.is_cuda:
            return nullcontext()
        if self._plan_stream is None:
            self._plan_stream = transport_stream(table.device)
        if layers.inputs_ready is not None:
            self._plan_stream.wait_event(layers.inputs_ready)
        else:
            self._plan_stream.wait_stream(torch.cuda.current_stream(table.device))
        return torch.cuda.stream(self._plan_stream)

    def _send(self, transfers: Sequence[Transfer], mode: str, timeout: float,
              layers: LayerStreaming | None) -> dict[Any, str | None]:
        self._times = [("send", time.perf_counter())]  # the first steps of a staged trace
        transfers = tuple(transfers)
        batch = Batch(self.side, tuple(p.side for p in self.peers), transfers, self.policy)
        refused: dict[Any, str] = {}
        ahead = chunks_run = None
        try:
            if self.refuse == "request":
                pending, errors = plan_each(batch, self._planner(prepared=mode == "prepared").plan)
                for t in transfers:
                    if t.request in errors and t.request not in refused:
                        refused[t.request] = f"request refused: {errors[t.request]}"
                        self._report(t.dest, t.request, refused[t.request])
                transfers = tuple(t for t in transfers if t.request not in errors)
            else:
                if layers is None:  # the chunks first: the receiver plans from them while this side plans
                    chunks_run = self._announce_chunks(transfers, batch, mode, timeout)
                pending = self._planner(prepared=mode == "prepared").plan(batch)
                self._times.append(("launched", time.perf_counter()))
                if layers is None:
                    ahead = self._gather_ahead(pending, batch, mode)
                    self._times.append(("queued", time.perf_counter()))
            if chunks_run is not None and "byte_offsets" in pending.planner.outputs:
                # a receiver-planned run: its byte counts come with the plan's report; its descriptors
                # stay on the device, and its sections unread, unless the run needs them after all (_Batch)
                descs, per_transfer, sections = None, pending.transfer_rows(), None
                nbytes = int(pending.section_byte_ends()[-1])
            else:
                descs, per_transfer = pending.descriptors()
                sections, nbytes = pending.sections(), int(descs[:, 2].sum(dtype=np.uint64))
            self._times.append(("planned", time.perf_counter()))
        except PlanError as err:
            self._cancel_chunks(chunks_run, f"batch refused: {err}")
            for t in transfers:
                self._report(t.dest, t.request, f"batch refused: {err}")
            raise
        if not transfers:
            return dict(refused)
        sums = self._checksums(transfers, pending, per_transfer, nbytes)
        if layers is not None:
            staged = mode == "staged" or mode == "auto" and self._auto_mode(len(descs), nbytes) == "staged"
            moved = self._send_layerwise(transfers, descs, sections, layers, time.monotonic() + timeout,
                                         (pending.device_descriptors(), self._alignment(batch)) if staged else None)
            return {**moved, **refused}
        if sums is not None:  # before the bytes: the decode checks a request as soon as it has landed
            self._send_checksums(transfers, sums)
        return {**self._move(transfers, mode, pending, _Batch(transfers, descs, per_transfer, sections, None, ahead=ahead,
                                                              chunks_run=chunks_run, nbytes=nbytes, pending=pending),
                             batch, timeout), **refused}

    def _checksums(self, transfers: tuple[Transfer, ...], pending, per_transfer: np.ndarray,
                   nbytes: int) -> torch.Tensor | None:
        """Each transfer's checksum, launched behind the plan, where a peer of the batch asked for them
        (:mod:`.integrity`); ``None`` where none did."""
        if not any(self.peers[t.dest].integrity for t in transfers):
            return None
        return transfer_sums(pending.device_descriptors(), per_transfer, nbytes)

    def _send_checksums(self, transfers: tuple[Transfer, ...], sums: torch.Tensor) -> None:
        """Add each chunk's checksum to its request's (on the device), and send a request's with its last
        chunk, ahead of the bytes: the host waits only for the sums of requests that finish here (the
        kernel over their source bytes, queued behind the plan). A chunk that fails later fails its
        request on the decode side anyway."""
        wanted = [k for k, t in enumerate(transfers) if self.peers[t.dest].integrity]
        if not wanted:
            return
        self._sums.add([(transfers[k].dest, transfers[k].request) for k in wanted],
                       sums[torch.tensor(wanted, device=sums.device)])
        last = [transfers[k] for k in wanted if transfers[k].last]
        for t, total in zip(last, self._sums.take([(t.dest, t.request) for t in last])):
            try:
                self.peers[t.dest].channel.send("checksum", {"request": t.request, "sum": total}, timeout=ACK_S)
            except KvplanError as err:  # its decode side is gone or stuck: it cannot complete the request anyway
                log.warning("request %r: its checksum could not be sent: %s", t.request, err)

    def _move(self, transfers: tuple[Transfer, ...], mode: str, pending, planned: "_Batch", batch: Batch,
              timeout: float) -> dict[Any, str | None]:
        deadline = time.monotonic() + timeout
        count = int(planned.per_transfer[-1])
        if mode == "auto":
            mode = self._auto_mode(count, planned.nbytes)
        self.last_mode = mode
        if mode != "staged":
            self._cancel_chunks(planned.chunks_run, f"sent {mode}")
        log.info("sending %d transfers (%d descriptors) %s", len(transfers), count, mode)
        sections = planned.host_sections() if mode != "staged" else planned.sections
        if mode == "direct":
            return self._send_direct(transfers, planned.host_descs(), sections, deadline)
        if mode == "prepared":
            return self._send_prepared(transfers, sections, pending.prepared_indices(), deadline)
        result: dict[Any, str | None] = {}
        for dest in sorted({t.dest for t in transfers}):  # each peer's share through its own staging ring
            if len(self.peers) == 1:
                one = replace(planned, device_descs=pending.device_descriptors())
            else:
                share = tuple(replace(t, dest=0) for t in transfers if t.dest == dest)
                sub = gpu.plan(Batch(self.side, (self.peers[dest].side,), share, self.policy))
                one = _Batch(share, *sub.descriptors(), sub.sections(), sub.device_descriptors())
            for request, reason in self._send_staged(dest, one, self._alignment(batch), deadline).items():
                result[request] = result.get(request) or reason
        return result

    def _planner(self, prepared: bool) -> Planner:
        """This endpoint's device planner (graph replay on a GPU), made on the first send of its kind."""
        planner = self._planners.get(prepared)
        sides = [p.side for p in self.peers]
        if planner is None or len(planner.dsts) != len(sides) or any(a is not b for a, b in zip(planner.dsts, sides)):
            outputs = ("descriptors", "prepared") if prepared else ("descriptors",)
            if self._ahead is not None or self.staging is not None and self.receiver_plans:
                outputs += ("byte_offsets",)  # staged runs read their byte counts and offsets from the plan
            planner = self._planners[prepared] = Planner(self.side, tuple(p.side for p in self.peers),
                                                         policy=self.policy, outputs=outputs)
        return planner

    def _auto_mode(self, count: int, nbytes: int) -> str:
        """``auto``'s choice for a batch of ``count`` descriptors moving ``nbytes``."""
        if self.staging is None or any(p.staging is None for p in self.peers) or not self.staging.is_cuda:
            return "direct"  # (on the CPU the gather and scatter kernels run interpreted: far slower)
        return "staged" if count >= AUTO_MIN_DESCS and nbytes <= AUTO_MAX_AVG_BYTES * count else "direct"

    def _peer_gone(self, peer: int) -> str | None:
        if self.peers[peer].channel.peer_gone():
            return "the decode side is gone: its control connection was lost"
        return None

    def _any_peer_gone(self, peers: Sequence[int]) -> str | None:
        return next((why for p in peers if (why := self._peer_gone(p)) is not None), None)

    def fail(self, requests: Sequence[Any], reason: str, peer: int = 0) -> None:
        """Tell decode endpoint ``peer`` that ``requests`` failed here before anything was sent (and
        drop their lists): its side fails them at once instead of at their deadline."""
        for request in requests:
            self._report(peer, request, reason)
        self.forget(requests, peer)

    def _report(self, peer: int, request: Any, reason: str) -> None:
        log.warning("request %r failed: %s", request, reason)
        try:
            self.peers[peer].channel.send("failed", {"request": request, "reason": reason}, timeout=0.5)
        except Exception as err:  # noqa: BLE001 - the peer may be gone; the failure is still ours to report
            log.warning("could not tell the decode side that %r failed: %s", request, err)

    def _fail(self, peer: int, result: dict[Any, str | None], requests, reason: str) -> None:
        for request in requests:
            if is_unsafe(reason):  # a write into its pages may still land: never acknowledged as fenced
                self.unsafe.add(request)
            if result.get(request) is None:
                result[request] = reason
                self._report(peer, request, reason)

    # -- direct and prepared ----------------------------------------------------------------------
    def _send_direct(self, transfers: Sequence[Transfer], descs: np.ndarray, sections: Sequence[Section],
                     deadline: float) -> dict[Any, str | None]:
        posted = []
        for s in sections:
            dest = transfers[s.transfer].dest
            peer = self.peers[dest]
            posted.append((self.engine.post(peer.name, descs[s.lo : s.hi], peer.notification(s)), s))
            log.debug("posted %s of %r: %d descriptors to peer %d", s.name, s.request, s.hi - s.lo, dest)
        return self._settle(transfers, posted, deadline)

    def _send_layerwise(self, transfers: Sequence[Transfer], descs: np.ndarray, sections: Sequence[Section],
                        layers: LayerStreaming, deadline: float,
                        staged: tuple[torch.Tensor, int] | None) -> dict[Any, str | None]:
        """Move each layer group's sections once the forward pass has written the group: posted as
        direct writes (waited for together at the end), or, with ``staged`` (the batch's device
        descriptors and alignment), as one staged run per group and peer."""
        pairings = [pair_sides(self.side, p.side) for p in self.peers]
        per_group = group_sections(sections, pairings, self.side, [t.dest for t in transfers], layers.groups)
        self.last_mode, self.last_announcement = ("staged", "table") if staged else ("direct", None)
        send = _GroupedSend(self, transfers, descs, per_group, layers, deadline, staged)
        send.run()
        result = self._settle(transfers, send.posted, deadline)
        if send.trace is not None:
            send.trace.append((len(per_group), "settled", time.perf_counter()))
            log.warning("layer groups (group, step, clock ms): %s",
                        [(g, k, round(t * 1e3, 3)) for g, k, t in send.trace])
        for request, reason in send.failed.items():
            result[request] = result.get(request) or reason
        return result

    @staticmethod
    def _group_run(transfers: Sequence[Transfer], dest: int, parts: Sequence[Any], descs: np.ndarray,
                   device_descs: torch.Tensor, alignment: int) -> "_Batch":
        """One layer group's share for peer ``dest`` as a staged batch: its parts' descriptors back to
        back (transfer by transfer), each part one section over them, announced with tables."""
        mine = [k for k, t in enumerate(transfers) if t.dest == dest]
        local = {k: i for i, k in enumerate(mine)}
        rows = np.concatenate([p.rows() for p in parts])
        counts = np.zeros(len(mine), np.int64)
        group_sections_, at = [], 0
        for p in parts:
            group_sections_.append(Section(local[p.transfer], p.request, p.role, p.name, at, at + p.num_descs, p.count,
                                           p.layers))
            counts[local[p.transfer]] += p.num_descs
            at += p.num_descs
        per_transfer = np.concatenate([[0], np.cumsum(counts)])
        index = torch.from_numpy(rows).to(device_descs.device, non_blocking=True)
        return _Batch([transfers[k] for k in mine], descs[rows], per_transfer, group_sections_,
                      device_descs.index_select(0, index), plannable=False)

    def _until_ready(self, readiness, group: int, posted: list[tuple[Handle, Any]], dests: Sequence[int],
                     deadline: float) -> str | None:
        """Wait (progressing what is posted; :mod:`.pause` between looks) until layer group ``group`` is written;
        the reason it never was, else ``None``."""
        pause = Pause(longest_s=1e-4)  # a group is written within milliseconds: short slices once quiet
        while readiness.ready() <= group:
            if time.monotonic() > deadline:
                return f"layer group {group} was not written before the deadline"
            if (gone := self._any_peer_gone(dests)) is not None:
                return gone
            for handle, _ in posted:
                if handle.state == "PROC" and self.engine.progress(handle) != "PROC":
                    pause.busy()
            pause()
        return None

    def _settle(self, transfers: Sequence[Transfer], posted: list[tuple[Handle, Any]],
                deadline: float) -> dict[Any, str | None]:
        result: dict[Any, str | None] = {t.request: None for t in transfers}
        dest_of = {handle: transfers[section.transfer].dest for handle, section in posted}
        outcome = wait_all(self.engine, [h for h, _ in posted], deadline, give_up=lambda h: self._peer_gone(dest_of[h]))
        for handle, section in posted:
            if outcome[handle] is not None:
                dest = transfers[section.transfer].dest
                # a dead receiver is the cause, whatever the engine says about the write
                self._fail(dest, result, [section.request], self._peer_gone(dest) or outcome[handle])
        return result

    def _prepare(self, dest: int) -> None:
        """NIXL prepared lists for every role, made once per peer (entry x slot descriptors)."""
        if not self.engine.capabilities.prepared:
            raise LayoutError(f"the {type(self.engine).__name__} has no prepared descriptor lists; use direct mode")
        peer = self.peers[dest]
        pairing = pair_sides(self.side, peer.side)
        tables = {KV_ROLE: (pairing.kv_src, pairing.kv_dst), AUX_ROLE: (pairing.aux_src, pairing.aux_dst)}
        tables.update({c: t for c, t in enumerate(zip(pairing.state_src, pairing.state_dst))})
        for role, (entries, src_slots, dst_slots) in prepared_slots(self.side, peer.side).items():
            src_t, dst_t = tables[role]
            items = lambda t, slots: np.concatenate([t, np.full((len(t), 1), slots, np.uint64)], axis=1)  # noqa: E731
            self.engine.prepare(peer.name, role, items(src_t, src_slots), items(dst_t, dst_slots))
        peer.prepared = True

    def _send_prepared(self, transfers: Sequence[Transfer], sections: Sequence[Section], indices: PreparedIndices,
                       deadline: float) -> dict[Any, str | None]:
        counted = {(s.transfer, s.role): s for s in sections}
        posted = []
        for s, (role, owner) in enumerate(zip(indices.section_role.tolist(), indices.section_transfer.tolist())):
            lo, hi = int(indices.section_offsets[s]), int(indices.section_offsets[s + 1])
            section = counted.get((owner, role))
            if lo == hi or section is None:
                continue
            dest = transfers[owner].dest
            if not self.peers[dest].prepared:
                self._prepare(dest)
            posted.append((self.engine.post_prepared(self.peers[dest].name, role, indices.src[lo:hi],
                                                     indices.dst[lo:hi],
                                                     self.peers[dest].notification(section)),
                             section))
        return self._settle(transfers, posted, deadline)

    # -- staged -----------------------------------------------------------------------------------
    def _send_staged(self, dest: int, batch: "_Batch", alignment: int, deadline: float) -> dict[Any, str | None]:
        return self._staged_run(dest, batch, alignment, deadline).go()

    def _alignment(self, batch: Batch) -> int:
        """:func:`~.local.plan_alignment` of the batch's sides (it depends on nothing else), kept per
        pairing: a send asks for it up to three times, and it walks every entry of both sides."""
        sides = (batch.src, *batch.dsts)
        kept = self._alignments
        if kept is None or len(kept[0]) != len(sides) or any(a is not b for a, b in zip(kept[0], sides)):
            kept = self._alignments = (sides, plan_alignment(batch))
        return kept[1]

    def _ring(self, dest: int, alignment: int) -> tuple[int, int]:
        """``(slots, slot_bytes)`` of the staging ring to peer ``dest``."""
        return staging_ring(min(self.staging.numel(), self.peers[dest].staging[1]), self.slots, alignment)

    def _staged_to_one(self, mode: str) -> bool:
        """Whether a send in ``mode`` will likely be one staged run to a single peer (``auto``: as the
        last send was), before its plan is seen: what is done ahead of the plan rests on it."""
        return len(self.peers) == 1 and self.staging is not None and self.peers[0].staging is not None and \
            (mode == "staged" or mode == "auto" and self.last_mode == "staged")

    def _gather_ahead(self, pending, batch: Batch, mode: str) -> GatherAhead | None:
        """Queue the first wave's gather behind ``pending`` when the send will likely be staged to a
        single peer (:mod:`.ahead`); its run uses it unless the batch turns out otherwise."""
        if self._ahead is None or not self._staged_to_one(mode):
            return None
        alignment = self._alignment(batch)
        return self._ahead.queue(pending, alignment, self._ring(0, alignment)[1])

    def _announce_chunks(self, transfers: Sequence[Transfer], batch: Batch, mode: str, timeout: float) -> int | None:
        """Announce a staged run's chunks to a receiver that plans it (:func:`.receiver_plan.planned_run_chunks`)
        before this side's plan is launched, so that both plan at once; its waves follow once this
        side's plan is seen and its first wave posted. The run's id, or ``None`` where the send will not be such a run."""
        peer = self.peers[0]
        if not (self.receiver_plans and transfers and self._staged_to_one(mode) and peer.plannable
                and all(t.request in peer.planning for t in transfers)):
            return None
        run, self._next_run = self._next_run, self._next_run + 1
        peer.channel.replaced()  # a connection made again before this run loses nothing of it
        try:
            peer.channel.send("staged-plan", planned_run_chunks(self.id, self._alignment(batch), transfers, run),
                              timeout=timeout)
        except ControlTimeout:
            return None  # (then announced whole, or failed, by the staged run)
        self._times.append(("chunks", time.perf_counter()))
        return run

    def _cancel_chunks(self, run: int | None, why: str) -> None:
        """Withdraw a run announced by its chunks that will not be sent as one (its requests are
        failed or sent otherwise, and told so by their own messages)."""
        if run is not None:
            try:
                self.peers[0].channel.send("staged-waves", {"from": self.id, "run": run, "cancel": why}, timeout=1.0)
            except ControlTimeout:
                log.warning("could not withdraw staged run %d from the decode side", run)

    def _staged_run(self, dest: int, batch: "_Batch", alignment: int, deadline: float) -> "_StagedRun":
        if self.staging is None or self.peers[dest].staging is None:
            raise LayoutError("staged mode needs a registered staging buffer on both sides")
        return _StagedRun(self, dest, batch, alignment, deadline)


@dataclass
class _Batch:
    """What staged mode needs of one peer's share of a planned batch."""

    transfers: Sequence[Transfer]
    descs: np.ndarray | None  # [n, 3] uint64 on the host (destination tables, wave cuts); None: not copied yet
    per_transfer: np.ndarray  # [T + 1] descriptor offsets
    sections: list[Section] | None  # None: not read from the plan yet
    device_descs: torch.Tensor  # the same descriptors on the device (what the gathers read)
    plannable: bool = True  # False: a part of a plan (a layer group) the receiver cannot plan itself
    ahead: GatherAhead | None = None  # its first wave, gathered behind the plan (.ahead)
    chunks_run: int | None = None  # the id under which its chunks were announced ahead of the plan
    nbytes: int | None = None  # the descriptors' bytes (None: summed from descs)
    pending: Any = None  # the plan, where descs were not copied to the host

    def __post_init__(self) -> None:
        if self.nbytes is None:
            self.nbytes = int(self.descs[:, 2].sum(dtype=np.uint64))

    def host_descs(self) -> np.ndarray:
        """The descriptors in host memory, copied from the plan the first time they are needed."""
        if self.descs is None:
            self.descs = self.pending.descriptors()[0]
        return self.descs

    def host_sections(self) -> list[Section]:
        """The sections, read from the plan's report the first time they are needed."""
        if self.sections is None:
            self.sections = self.pending.sections()
        return self.sections


def split_descriptors(descs: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Descriptors of at most ``limit`` bytes: ``(pieces, first)``; descriptor ``i`` became pieces
    ``first[i]:first[i + 1]`` (``limit`` keeps the alignment when it is a multiple of it). When none
    is larger than ``limit``: ``(descs, None)``, with nothing copied."""
    if not len(descs) or int(descs[:, 2].max()) <= limit:  # the usual case
        return descs, None
    sizes = descs[:, 2].astype(np.int64)
    count = np.maximum(1, -(-sizes // limit))
    first = np.concatenate([[0], np.cumsum(count)])
    if int(first[-1]) == len(descs):
        return descs, first
    owner = np.repeat(np.arange(len(descs)), count)
    k = (np.arange(int(first[-1])) - first[owner]).astype(np.uint64)
    step = np.uint64(limit)
    pieces = np.empty((int(first[-1]), 3), np.uint64)
    pieces[:, 0] = descs[owner, 0] + k * step
    pieces[:, 1] = descs[owner, 1] + k * step
    pieces[:, 2] = np.minimum(descs[owner, 2] - k * step, step)
    return pieces, first


class _GroupedSend:
    """One streamed send (:meth:`PrefillEndpoint.send` with ``layers``): each layer group once the
    forward pass has marked it. A group's staged runs are announced while the forward pass still
    writes it (destination tables, byte offsets on the device): once it is marked, its bytes need
    only gathering and writing."""

    def __init__(self, ep: PrefillEndpoint, transfers: Sequence[Transfer], descs: np.ndarray, per_group: list,
                 layers: LayerStreaming, deadline: float, staged: tuple[torch.Tensor, int] | None):
        self.ep, self.transfers, self.descs, self.per_group = ep, transfers, descs, per_group
        self.layers, self.deadline, self.staged = layers, deadline, staged
        self.dests = sorted({t.dest for t in transfers})
        self.posted: list[tuple[Handle, Any]] = []  # direct writes, waited for together at the end
        self.failed: dict[Any, str | None] = {}
        self.announced: dict[int, list[_StagedRun]] = {}
        self.runs: list[_StagedRun] = []  # every group's, in order: their traces are logged at the end, not
        # while the next group's mark may come (logging takes long)
        self.trace: list | None = [] if os.environ.get("KVPLAN_TRACE") else None

    def merge(self, result: dict[Any, str | None]) -> None:
        for request, reason in result.items():
            self.failed[request] = self.failed.get(request) or reason

    def announce(self, g: int) -> None:
        """Announce group ``g``'s staged runs (one per peer) ahead of its mark."""
        if self.staged is None or g >= len(self.per_group) or g in self.announced:
            return
        ep, runs = self.ep, []
        for dest in self.dests:
            mine = [s for s in self.per_group[g] if self.transfers[s.transfer].dest == dest]
            if mine:
                share = ep._group_run(self.transfers, dest, mine, self.descs, *self.staged)
                run = ep._staged_run(dest, share, self.staged[1], self.deadline)
                self.runs.append(run)
                if run.announce():
                    runs.append(run)
                else:
                    self.merge(run.result)
        self.announced[g] = runs

    def queue_ahead(self, g: int) -> None:
        """Queue the gathers of group ``g``'s first waves behind its mark, into the slots that are
        free: only once the group before it has moved, whose waves used them."""
        written = getattr(self.layers.readiness, "written", None)
        runs = self.announced.get(g)
        if runs and written is not None:  # the runs share the staging slots: only the first goes ahead
            runs[0].gather_ahead(written(g))

    def run(self) -> None:
        try:
            self._run()
        finally:
            for run in self.runs:
                run.log_trace()

    def _run(self) -> None:
        ep = self.ep
        self.announce(0)
        self.queue_ahead(0)
        for g, parts in enumerate(self.per_group):
            why = ep._until_ready(self.layers.readiness, g, self.posted, self.dests, self.deadline)
            self._mark(g, "ready")
            if why is not None:  # nothing of this group or later ones goes out
                for s in (s for later in self.per_group[g:] for s in later):
                    ep._fail(self.transfers[s.transfer].dest, self.failed, [s.request], why)
                return
            if self.staged is not None:
                # the next group's tables go out first: the receiver checks them while this group moves
                self.announce(g + 1)
                for run in self.announced.pop(g):
                    self.merge(run.move())
                self.queue_ahead(g + 1)
            else:
                for s in parts:
                    rows = self.descs[s.spans[0][0]:s.spans[0][1]] if len(s.spans) == 1 else self.descs[s.rows()]
                    peer = ep.peers[self.transfers[s.transfer].dest]
                    self.posted.append((ep.engine.post(peer.name, rows, peer.notification(s)), s))
            self._mark(g, "sent")

    def _mark(self, group: int, step: str) -> None:
        if self.trace is not None:
            self.trace.append((group, step, time.perf_counter()))


class _StagedRun:
    """One batch through the staging ring (see :class:`PrefillEndpoint`)."""

    def __init__(self, ep: PrefillEndpoint, dest: int, batch: _Batch, alignment: int, deadline: float):
        self.ep, self.dest, self.peer = ep, dest, ep.peers[dest]
        self.alignment, self.deadline = alignment, deadline
        self.result: dict[Any, str | None] = {t.request: None for t in batch.transfers}
        self.slots, self.slot_bytes = ep._ring(dest, alignment)
        self.transfers, self.plannable, self.chunks_run = batch.transfers, batch.plannable, batch.chunks_run
        self.batch, self.nbytes = batch, batch.nbytes
        if batch.descs is None and batch.nbytes <= self.slot_bytes:  # one wave, no descriptor to split:
            self.descs, first = None, None  # its sizes are not needed (announce)
        else:
            self.descs, first = split_descriptors(batch.host_descs(), self.slot_bytes)
        self.count = int(batch.per_transfer[-1]) if first is None else len(self.descs)
        device_descs = batch.device_descs
        if first is not None:  # a descriptor larger than a slot goes in pieces
            device_descs = torch.from_numpy(self.descs.view(np.int64)).to(device_descs.device)
            self.sections = [replace(s, lo=int(first[s.lo]), hi=int(first[s.hi])) for s in batch.host_sections()]
            self.rows = first[batch.per_transfer]  # each transfer's rows
        else:  # (a run the receiver plans needs no sections: it counts its own)
            self.sections = batch.host_sections() if self.descs is not None else batch.sections
            self.rows = batch.per_transfer
        self.device_descs = device_descs
        # the first wave, gathered behind the plan (.ahead): usable unless the descriptors were re-split
        self.ahead = batch.ahead if first is None and batch.ahead is not None and \
            batch.ahead.serves(device_descs, self.slot_bytes) else None
        self._owners: np.ndarray | None = None
        self.host_starts: np.ndarray | None = None  # each descriptor's byte offset, where descs are on the host
        if self.descs is not None:
            self.host_starts = np.zeros(len(self.descs) + 1, np.int64)
            np.cumsum(self.descs[:, 2].view(np.int64), out=self.host_starts[1:])
        if ep._ahead is not None and self.count:  # what the next run's gather ahead expects
            ep._ahead.typical = max(1, self.nbytes // self.count)
        self.dev_starts: torch.Tensor | None = None  # made after the announcement has left
        self.remote_free = [True] * self.slots
        self.local_write: list[Handle | None] = [None] * self.slots
        self.gathered: list[tuple[Wave, Any]] = []  # waves gathered, not yet posted, in order
        self.writes: dict[int, tuple[np.ndarray, bytes]] = {}  # a gathered wave's region and note, made ahead
        self.next_wave = 0  # waves [0, next_wave) are gathered (or queued to be)
        self.posted: dict[int, tuple[Wave, Handle]] = {}
        self.acked: set[int] = set()
        self.gone: str | None = None  # why the receiver is known to be gone
        self.base_id = 0  # the id of its first wave: taken from the endpoint when announced
        self.waves: list[Wave] = []  # planned when announced
        self.deferred: dict[str, Any] | None = None  # a staged-waves header sent once the first wave is posted
        self.trace: list[tuple[int, str, float]] | None = None
        if os.environ.get("KVPLAN_TRACE"):
            self.trace = [(0, step, t) for step, t in ep._times]
            self._mark(0, "init")

    @property
    def owners(self) -> np.ndarray:
        """Each descriptor's request (made when first asked: only failures need it)."""
        if self._owners is None:
            requests = np.array([t.request for t in self.transfers] + [None], dtype=object)[:-1]
            self._owners = np.repeat(requests, np.diff(self.rows))
        return self._owners

    def go(self) -> dict[Any, str | None]:
        """Announce the run, then move it (see :meth:`announce` and :meth:`move`)."""
        if not self.announce():
            return self.result
        result = self.move()
        self.log_trace()
        return result

    def announce(self) -> bool:
        """Send the run's announcement (its waves, with destination tables or chunk bounds) and make
        its byte offsets on the device; ``False`` when it could not be sent (its requests have then
        failed). A layer-group run is announced while the forward pass still writes the group, so
        that its bytes only need gathering and writing once the group is ready."""
        ep = self.ep
        if self.descs is None:
            waves = self.waves = one_wave(self.count, self.nbytes, self.sections or [])
        else:
            waves = self.waves = plan_waves(self.descs[:, 2], self.sections, self.slot_bytes, self.slots,
                                            ends=self.host_starts[1:])
        self.base_id = ep._next_wave
        ep._next_wave += len(waves)
        frames: tuple[bytes, ...] = ()
        # a connection made again before this run (or since its chunks went ahead) loses nothing of it
        replaced = self.peer.channel.replaced()
        if self.chunks_run is not None and not replaced:  # its chunks went ahead: its waves complete it
            kind, header = "staged-waves", planned_run_waves(ep.id, self.base_id, waves, self.slot_bytes,
                                                             run=self.chunks_run)
            ep.last_announcement = "planned"
        elif ep.receiver_plans and self.peer.plannable and self.plannable and \
                all(t.request in self.peer.planning for t in self.transfers):
            kind, header = "staged-plan", planned_run_message(ep.id, self.base_id, waves, self.slot_bytes,
                                                              self.alignment, self.transfers)
            ep.last_announcement = "planned"
        else:
            spans = [(t.request, int(self.rows[k]), int(self.rows[k + 1])) for k, t in enumerate(self.transfers)]
            if self.descs is None:  # a light run announced with tables after all (_Batch)
                waves[0].sections = self.batch.host_sections()
            header, table = run_message(ep.id, self.base_id, waves, self.slot_bytes, self.alignment, spans,
                                        self.batch.host_descs() if self.descs is None else self.descs)
            kind, frames = "staged", (table,)
            ep.last_announcement = "table"
        if kind == "staged-waves":
            # the receiver plans from the chunks already: the first wave is posted first, its waves
            # right after (a landing before them waits on the receiver, decode._early)
            self.deferred = header
        else:
            try:  # announced first: the receiver plans or checks the run while this side gathers and writes
                self.peer.channel.send(kind, header, *frames, timeout=max(0.0, self.deadline - time.monotonic()))
            except ControlTimeout as err:
                ep._fail(self.dest, self.result, list(self.result), str(err))
                return False
            self._mark(0, "tables")
        device_descs = self.device_descs
        if self.ahead is not None:  # the offsets and the first wave's gather are queued already
            self.dev_starts = self.ahead.offsets[: self.count]
            self.remote_free[waves[0].slot] = False
            self.gathered.append((waves[0], self.ahead.event))
            self.next_wave = 1
            ep.first_waves_ahead += 1
            self._mark(0, "ahead")
        elif ep._stream is not None:  # the descriptors were made on the current stream
            ep._stream.wait_stream(torch.cuda.current_stream(ep.staging.device))
            with torch.cuda.stream(ep._stream):  # each descriptor's offset in the whole batch's byte stream
                self.dev_starts = torch.cumsum(device_descs[:, 2], 0).sub_(device_descs[:, 2])
        else:
            self.dev_starts = torch.cumsum(device_descs[:, 2], 0) - device_descs[:, 2]
        return True

    def gather_ahead(self, written: Any) -> int:
        """Queue the gathers of the first waves whose slots are free behind ``written`` (a CUDA event
        the forward pass records once the run's layer group is written): they run the moment the
        group is written, and :meth:`move` posts them once done. How many were queued."""
        if self.ep._stream is None or written is None:
            return 0
        self.ep._stream.wait_event(written)
        start = self.next_wave
        while self.next_wave < len(self.waves) and self._slot_free(self.waves[self.next_wave].slot):
            self._gather(self.waves[self.next_wave])
        self._mark(0, "ahead")
        self.ep.waves_ahead += self.next_wave - start
        return self.next_wave - start

    def move(self) -> dict[Any, str | None]:
        """Gather, write and wait for the credits of every wave of an announced run; the result per request."""
        ep, waves = self.ep, self.waves
        while self.next_wave < len(waves):
            wave = waves[self.next_wave]
            if not self._wait(lambda: self._slot_free(wave.slot)):
                break
            self._mark(wave.index, "gather0")
            self._gather(wave)
            self._pump()
        self._wait(lambda: not self.gathered and all(i in self.acked for i in self.posted))
        live = [h for _, h in self.posted.values() if h.state == "PROC"]
        outcome = wait_all(ep.engine, live, time.monotonic()) if live else {}  # aborts what is still in flight
        for index, (wave, handle) in self.posted.items():
            reason = outcome.get(handle) or handle.error
            if index not in self.acked:  # a dead receiver is the cause, whatever the engine says
                reason = self.gone or reason or "the receiver did not acknowledge its staged wave before the deadline"
            if reason is not None:
                ep._fail(self.dest, self.result, wave.requests(self.owners), reason)
        for wave in [w for w, _ in self.gathered] + waves[self.next_wave:]:
            ep._fail(self.dest, self.result, wave.requests(self.owners), self.gone or "deadline passed before the wave was sent")
        return self.result

    def log_trace(self) -> None:
        """Log what ``KVPLAN_TRACE`` recorded of this run's waves (each step on the clock)."""
        if self.trace is not None:
            log.warning("staged waves (wave, step, clock ms): %s", [(self.base_id + w, k, round(t * 1e3, 3))
                                                                    for w, k, t in self.trace])

    def _mark(self, wave: int, step: str) -> None:
        if self.trace is not None:
            self.trace.append((wave, step, time.perf_counter()))

    def _slot_free(self, slot: int) -> bool:
        """Whether the receiver has returned the slot's credit and this side's last write from it has ended."""
        handle = self.local_write[slot]
        return self.remote_free[slot] and (handle is None or handle.state != "PROC")

    def _wait(self, ready) -> bool:
        """Pump until ``ready()`` or the deadline; never sleeps (yields the core between looks)."""
        pause = Pause()
        while True:
            if self._pump():
                pause.busy()
            if ready():
                return True
            if time.monotonic() > self.deadline:
                return False
            if self.gone is None and (gone := self.ep._peer_gone(self.dest)) is not None:
                self.gone = gone
            if self.gone is None and self.peer.channel.replaced():  # what was in flight on the old one is lost
                self.gone = ("the control connection to the decode side was lost and made again during the staged "
                             "run: credits in flight on it may be lost")
            if self.gone is not None:
                return False
            pause([self.peer.channel])  # yields while waves move; once quiet a credit on the channel wakes it

    def _gather(self, wave: Wave) -> None:
        """Gather a wave into its slot: the batch-wide offsets, shifted onto the slot (no per-wave tensors)."""
        ep = self.ep
        slot_lo = wave.slot * self.slot_bytes
        shift = slot_lo - wave.byte_lo
        descs, offsets = self.device_descs[wave.lo : wave.hi], self.dev_starts[wave.lo : wave.hi]
        typical = max(1, wave.nbytes // max(1, wave.hi - wave.lo))
        self.remote_free[wave.slot] = False
        if ep._stream is not None:
            with torch.cuda.stream(ep._stream):
                gather(descs, offsets, ep.staging, self.alignment, typical_bytes=typical, need=slot_lo + wave.nbytes,
                       shift=shift)
                event = torch.cuda.Event()
                event.record(ep._stream)
        else:
            gather(descs, offsets, ep.staging, self.alignment, typical_bytes=typical, need=slot_lo + wave.nbytes,
                   shift=shift)
            event = None
        self.gathered.append((wave, event))
        self.next_wave += 1
        self.writes[wave.index] = self._write_args(wave)
        self._mark(wave.index, "gather")

    def _write_args(self, wave: Wave) -> tuple[np.ndarray, bytes]:
        """A wave's region (from its slot here to the same slot there) and notification. Made when it
        is gathered: a gather queued ahead of its mark then leaves only the engine's post on the path."""
        slot_lo = wave.slot * self.slot_bytes
        return (np.array([[self.ep.staging.data_ptr() + slot_lo, self.peer.staging[0] + slot_lo, wave.nbytes]],
                         np.uint64), wave_note(self.base_id + wave.index, self.ep.id))

    def _pump(self) -> bool:
        """Post gathered waves whose gather has finished; take in credits; progress writes. Whether
        anything moved (or a gather is still running on the device, which ends within microseconds)."""
        ep = self.ep
        before = (len(self.posted), len(self.acked), len(self.gathered))
        while self.gathered and (self.gathered[0][1] is None or self.gathered[0][1].query()):
            wave, _ = self.gathered.pop(0)
            self._mark(wave.index, "gathered")  # seen done: what follows is the engine's post
            self._post(wave)
        while (msg := self.peer.channel.try_recv()) is not None:
            kind, header, _ = msg
            if kind != "wave-done":  # e.g. the next requests' lists: kept for receive_requests
                self.peer.backlog.append(msg)
                continue
            try:
                self._credit(int(header["wave"]), header.get("error"))
            except (KeyError, TypeError, ValueError, OverflowError):
                log.warning("ignored a malformed credit from the decode side: %r", header)
        # credits through the engine are looked for only while some are due: a loop that asks the engine
        # for notifications while it waits for a gather contends for the UCX worker with NIXL's progress
        # thread, and the next post waits for it (benchmarks/post_cost.py)
        if self.peer.credits_by_engine and len(self.acked) < len(self.posted):
            for _, raw in ep.engine.notifications():
                wave_id = decode_credit(raw)
                if wave_id is None:
                    log.warning("ignored an engine notification that is no credit: %r", raw[:80])
                else:
                    self._credit(wave_id, None)
        for wave, handle in self.posted.values():
            if handle.state == "PROC":
                ep.engine.progress(handle)
        return bool(self.gathered) or before != (len(self.posted), len(self.acked), len(self.gathered))

    def _credit(self, wave_id: int, error: Any) -> None:
        """Wave ``wave_id``'s slot is free again (the receiver scattered it, or refused it with ``error``)."""
        index = wave_id - self.base_id
        if index not in self.posted:
            if error and 0 <= index < len(self.waves):  # refused before it was posted: it never will be
                self.ep._fail(self.dest, self.result, self.waves[index].requests(self.owners),
                              f"the receiver refused the wave: {error}")
            return
        wave, _ = self.posted[index]
        self.acked.add(index)
        self._mark(index, "ack")
        self.remote_free[wave.slot] = True
        if error:
            self.ep._fail(self.dest, self.result, wave.requests(self.owners), f"the receiver refused the wave: {error}")

    def _post(self, wave: Wave) -> None:
        try:
            self._write(wave)
        finally:
            if self.deferred is not None:
                self._send_deferred()

    def _send_deferred(self) -> None:
        """Send the waves held back until the first wave was posted (see :meth:`announce`)."""
        header, self.deferred = self.deferred, None
        try:
            self.peer.channel.send("staged-waves", header, timeout=max(0.0, self.deadline - time.monotonic()))
        except ControlTimeout as err:
            self.gone = self.gone or str(err)
            self.ep._fail(self.dest, self.result, list(self.result), str(err))
            return
        self._mark(0, "tables")

    def _write(self, wave: Wave) -> None:
        ep = self.ep
        if any(v is not None for v in self.result.values()) and \
                all(self.result[r] is not None for r in wave.requests(self.owners)):
            self.remote_free[wave.slot] = True  # every request of it has failed already: nothing to write
            return
        region, note = self.writes.pop(wave.index, None) or self._write_args(wave)
        handle = ep.engine.post(self.peer.name, region, note, reuse=("slot", wave.slot, wave.nbytes))
        self._mark(wave.index, "post")
        self.posted[wave.index] = (wave, handle)
        self.local_write[wave.slot] = handle
