"""The sending side of a hand-off: pairing, planning, and moving a batch through the engine.

:class:`PrefillEndpoint` pairs with the layout a decode side published, plans each batch with
kvplan and moves it:

* ``direct``: every section (a transfer's KV, each state component, aux) is posted as one engine
  write with its notification, all of them before waiting for any;
* ``prepared``: the same through NIXL prepared descriptor lists, made once per peer, with the
  planner's int32 indices;
* ``staged``: waves of descriptors gathered into a ring of staging slots, one engine write each,
  announced to the receiver ahead of the bytes;
* ``auto`` (the default): staged when both sides have staging buffers on a GPU and the batch has at least
  64 descriptors of at most 256 KiB on average, else direct. (TensorRT-LLM gates at 1024 and 16 KiB;
  on an H200 through CUDA IPC a direct write costs ~10 us per descriptor, so staging wins far
  beyond 16 KiB: see benchmarks/RESULTS.md.) Always direct with an engine that writes from the plan's
  device descriptors in one launch (the ``ipc`` engine).

A send with ``layers`` streams the batch in layer groups while the forward pass writes it. Each mode
is a sender of its own (:mod:`.senders`); all of them end through this endpoint's one completion
and fencing path: a write that misses its deadline is aborted, and reported failed only once it
has ended.

What it reads from its decodes (pairings, registrations, publications, aborts) is
:mod:`.prefill_messages`; a decode as it sees one is :class:`~.prefill_peers.Peer`; how each mode moves a
batch is :mod:`.senders`.

Example::

    prefill = PrefillEndpoint(side, make_engine("nixl", "prefill"), ControlChannel(port, host="127.0.0.1"))
    prefill.accept(timeout=30)
    prefill.receive_requests(1, timeout=30)
    result = prefill.send([prefill.transfer(Chunk("r1", src_row=4, start=0, fill_len=4097, prompt_len=4096,
                                                     last=True, aux_src=4))])     # {"r1": None} when sent
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .. import env
from ..errors import InputError, KvplanError, LayoutError, PeerError, PlanError
from ..planner.contract.batch import Batch, Policy, SideMemory, Transfer
from ..planner.device.planner import Planner
from ..planner.device.isolate import plan_each
from .ahead import AheadGatherer
from .control import ControlChannel, ControlTimeout
from .copy_graphs import CopyGraphs, copy_graphs_enabled
from .decode import engine_regions
from .engines import Engine
from .auth import checksum_key
from .integrity import RunningSums, transfer_sums
from .local import warm_up
from .readiness import LayerStreaming
from .runtime.loop import engine_fds
from .runtime.moving import Done, Moving, drive, then
from .senders import SENDERS, streamed
from .senders.context import SendContext, SendVerbs
from .senders.planned import PlannedBatch
from .handles import SendHandle
from .prefill_ahead import AheadOfPlan
from .prefill_failures import FailurePath
from .prefill_messages import DecodeMessages
from .prefill_warm import WarmUp
from .prefill_peers import ACK_S, Peer
from .progress_thread import MAX_IN_FLIGHT, ProgressThread
from .stats import EndpointStats
from .streams import transport_stream
from .control_messages import Kind

__all__ = ["Chunk", "MODES", "Peer", "PrefillEndpoint"]

log = logging.getLogger(__name__)

MODES = ("auto", "direct", "prepared", "staged")
AUTO_MIN_DESCS, AUTO_MAX_AVG_BYTES = 64, 256 << 10
# per decode endpoint, the requests whose lists it may have published here and not yet had sent or failed: a
# decode holds at most its running requests' pages (SGLang's max_running_requests is in the hundreds to
# low thousands); an endpoint that publishes lists it never has sent cannot make this side hold more
MAX_PUBLISHED = 16384
# decode endpoints taken through add_peer() (a listener's) that are paired or pairing at once, gone ones
# not counted: each holds a control socket and an engine connection
MAX_PEERS = 256


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


class PrefillEndpoint(DecodeMessages, FailurePath, AheadOfPlan, WarmUp):
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
                 refuse: str = "batch", receiver_plans: bool = True, compat: str | None = None,
                 max_in_flight: int = MAX_IN_FLIGHT, max_published: int = MAX_PUBLISHED, max_peers: int = MAX_PEERS):
        env.validate()  # every KVPLAN_* variable set here, checked once, before anything starts
        if refuse not in ("batch", "request"):
            raise ValueError(f"refuse must be 'batch' or 'request', got {refuse!r}")
        self.side, self.engine, self.staging, self.policy, self.refuse = side, engine, staging, policy, refuse
        self.receiver_plans = receiver_plans
        self.compat = compat  # a decode endpoint pairs only with the same word (DecodeEndpoint's ``compat``)
        self.max_in_flight = max_in_flight  # batches queued or moving at once once submitted (.progress_thread)
        # bounds on what decode endpoints make this side hold (docs/failures.md §11)
        self.max_published, self.max_peers = max_published, max_peers
        self._thread: ProgressThread | None = None  # started by the first submit()
        # channels taken by add_peer() on a started endpoint, until their registration comes: (channel, deadline)
        self._pairing: list[tuple[ControlChannel, float]] = []
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
        self._next_run = 0  # ids of runs announced by their chunks ahead of their waves
        self.id = uuid.uuid4().hex[:12]  # names this sender's waves on receivers that have several senders
        # (peer, request, reason) of requests a decode endpoint aborted (its lists are dropped); the caller drains it
        self.aborted: list[tuple[int, Any, str]] = []
        self._aborts: deque[tuple[int, Any, str]] = deque()  # as they are read, moved into aborted by progress()
        # (peer, request) of aborts of requests it holds no lists of; the last 4096 (a caller that never
        # drains it keeps no more)
        self.given_up: deque[tuple[int, Any]] = deque(maxlen=4096)
        # (peer, request, reason) of requests a decode endpoint refused before publishing them (an admission
        # bound there: DecodeEndpoint.refuse); the last 4096; the caller pops them
        self.refused: deque[tuple[int, Any, str]] = deque(maxlen=4096)
        # per request, how many decode endpoints publish it here, where they said (a decode of a larger TP
        # size spreads each request over several ranks this one serves: it may go only once all have published)
        self.publishers: dict[Any, int] = {}
        # requests with a write that could not be ended (wait_all's "unsafe"): their aborts are not fenced
        self.unsafe: set[Any] = set()
        self.launches_ahead = 0  # direct sends launched behind their plan (_launch_ahead), over this endpoint's life
        # (device engines) the last direct send's bytes per descriptor: the next launch ahead's copy shape
        self._device_typical: int | None = None
        self._planners: dict[bool, Planner] = {}  # by prepared or not
        self._alignments: tuple[tuple[SideMemory, ...], int] | None = None  # the last sides' copy word
        self._sums = RunningSums()  # (peer, request) -> its chunks' checksum so far, on the device (.integrity)
        self._warm_shape: tuple[int, int] | None = None  # warm_up's batch bound, applied to peers as they pair
        self._touched: set[int] = set()  # peers whose staging share the warm-up has written (its runs may be there now)
        self._stats = EndpointStats("prefill")
        self.last_nbytes = 0  # the bytes the last send planned
        # what the senders see of this endpoint (.senders.context): never the endpoint itself
        self.sending = SendContext(self.id, engine, side, self.peers, policy, staging, self._stream, self._ahead,
                                   receiver_plans, SendVerbs(self._settle, self._fail, self._alignment, self._ring,
                                                             self._peer_gone, self._any_peer_gone, self.stats_hit))

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
        self._before_thread("accept")
        deadline = time.monotonic() + timeout
        for k, peer in enumerate(self.peers):
            kind, header, frames = peer.recv(deadline)
            while kind == Kind.WAVE_DONE:  # a receiver that outlived an earlier sender may still answer its waves
                kind, header, frames = peer.recv(deadline)
            if kind != Kind.REGISTER:
                raise LayoutError(f"expected a registration, got {kind!r}")
            self._on_register(k, header, frames)

    def _before_thread(self, call: str) -> None:
        """Pairing and warming read the channels on the caller's thread: only before the progress thread."""
        if self._thread is not None:
            raise RuntimeError(f"{call}() pairs on the caller's thread: call it before the first submit(), which "
                               "gives the channels to the progress thread")

    def add_peer(self, channel: ControlChannel, timeout: float) -> int | None:
        """Take one more decode endpoint, on ``channel``: wait for its registration and pair with it
        (as :meth:`accept`); its index. On a timeout or a refused pairing the channel is closed, it
        is not added, and the error is raised.

        On an endpoint whose progress thread runs (after the first :meth:`submit`) it returns at once
        (``None``): the thread pairs once the registration comes, within ``timeout`` (else it closes
        the channel, logged); a refused pairing is raised by the next :meth:`progress`. The new peer
        is in :attr:`peers` once paired."""
        if self._thread is not None:
            self._thread.call(lambda: self._take_pairing(channel, time.monotonic() + timeout))
            return None
        if (refused := self._refused_by_bound(channel)) is not None:
            raise PeerError(refused)
        self.peers.append(Peer(channel, owned=True))
        k = len(self.peers) - 1
        try:
            kind, header, frames = channel.recv(time.monotonic() + timeout)
            if kind != Kind.REGISTER:
                raise LayoutError(f"expected a registration, got {kind!r}")
            self._on_register(k, header, frames)
        except BaseException:
            self.peers.pop()
            channel.close()
            raise
        return k

    def published_by_all(self, request: Any) -> bool:
        """Whether every decode endpoint that publishes ``request`` here has (:attr:`publishers`; one where
        none said otherwise)."""
        return sum(request in p.lists for p in self.peers) >= self.publishers.get(request, 1)

    def receive_requests(self, count: int, timeout: float, peer: int = 0) -> None:
        """Receive ``count`` requests' destination lists (wire messages) from decode endpoint ``peer``
        (a wait, up to ``timeout``: for start-up and tests, not for a scheduler's thread)."""
        deadline = time.monotonic() + timeout
        if self._thread is not None:
            if self._thread.take_arrivals(count, peer, deadline) < count:
                raise ControlTimeout(f"fewer than {count} requests' lists came from decode endpoint {peer} "
                                     f"within {timeout} s")
            return
        p = self.peers[peer]
        for _ in range(count):
            kind, header, frames = p.recv(deadline)
            if kind != Kind.REQUEST:
                raise LayoutError(f"expected destination lists, got {kind!r}")
            self._on_request(peer, header, frames)

    def footprint(self) -> dict[str, int]:
        """How many entries this endpoint's per-request tables hold, over every peer (what ``kvplan
        load`` watches for growth)."""
        return {"lists": sum(len(p.lists) for p in self.peers), "planning": sum(len(p.planning) for p in self.peers),
                "backlog": sum(len(p.backlog) for p in self.peers), "unsafe": len(self.unsafe),
                "aborted": len(self.aborted), "checksums": len(self._sums), "publishers": len(self.publishers)}

    def stats(self) -> dict[str, Any]:
        """The operator's counters (:mod:`.stats`): requests by outcome (``sent``: its last chunk went;
        ``failed``), bytes sent, failures by cause, the time of the sends that ended requests (p50,
        p99 in ms), requests in flight (published here and not yet forgotten) and bounds hit.

        Example::

            prefill.stats()["failures"]
        """
        return self._stats.snapshot(in_flight=sum(len(p.lists) for p in self.peers))

    def totals(self) -> dict[str, Any]:
        """:meth:`stats`' cumulative counters alone, without percentiles (cheap: an engine's step may ask)."""
        return self._stats.totals()

    # what the last send left for the caller to read (kept by the senders' context)
    @property
    def last_mode(self) -> str | None:
        """The mode the last send used (what ``auto`` chose)."""
        return self.sending.last_mode

    @property
    def last_announcement(self) -> str | None:
        """How the last staged run was announced: ``"planned"`` (its chunks) or ``"table"``."""
        return self.sending.last_announcement

    @property
    def waves_ahead(self) -> int:
        """Staged waves gathered ahead of their layer group's mark, over this endpoint's life."""
        return self.sending.waves_ahead

    @property
    def first_waves_ahead(self) -> int:
        """Staged runs whose first wave was gathered behind the plan (:mod:`.ahead`)."""
        return self.sending.first_waves_ahead

    def stats_hit(self, bound: str) -> None:
        """Count a bound reached once (for the senders: a staged wave that waits for a free slot)."""
        self._stats.hit(bound)

    def transfer(self, chunk: Chunk, peer: int = 0) -> Transfer:
        """The :class:`Transfer` of a chunk to decode endpoint ``peer``, with the lists it published.
        Raises :class:`~kvplan.errors.InputError` naming the request when that peer holds none of it: on
        an endpoint whose progress thread runs, an abort read there drops a request's lists at any
        moment, so a caller's earlier look at :attr:`Peer.lists` may no longer hold."""
        published = self.peers[peer].lists.get(chunk.request)
        if published is None:
            raise InputError(chunk.request, f"decode endpoint {peer} holds no destination lists of it (aborted, "
                                            "forgotten or never published)")
        lists, aux_dst, prefix_len = published
        return Transfer(chunk.request, chunk.src_row, chunk.start, chunk.fill_len, chunk.prompt_len, chunk.last,
                        lists.pages, prefix_len, chunk.aux_src, aux_dst, lists.state, dest=peer)

    def forget(self, requests: Sequence[Any], peer: int | None = None) -> None:
        """Drop the destination lists of finished requests (of one peer, or of all). With a progress
        thread, that thread drops them at its next turn (a batch not started yet then sends nothing of them)."""
        if self._thread is not None:
            requests = list(requests)
            self._thread.call(lambda: self._forget_now(requests, peer))
            return
        self._forget_now(requests, peer)

    def between_batches(self, action: Callable[[], None]) -> None:
        """Run ``action`` where this endpoint's peers and engine are owned: on its progress thread at its next
        turn (between its looks at the batches moving), in order with the calls queued before it, or now where
        none runs. For an integration whose peers speak another protocol (SGLang's decode ranks:
        :mod:`kvplan.integrations.sglang.decode_ranks`)."""
        if self._thread is not None:
            self._thread.call(action)
        else:
            action()

    def _forget_now(self, requests: Sequence[Any], peer: int | None = None) -> None:
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

    def submit(self, transfers: Sequence[Transfer], mode: str = "auto", timeout: float = 30.0,
               layers: LayerStreaming | None = None) -> SendHandle:
        """Queue a batch for this endpoint's progress thread and return its :class:`SendHandle` at once:
        the thread plans it (after the caller's stream as it is now), posts it, waits for its writes
        and settles it, as :meth:`send` does, while the caller goes on. ``timeout`` counts from now.

        Batches go in the order submitted; at most ``max_in_flight`` are queued or moving at once, and
        one more is refused whole (each request failed with an ``overload`` reason, nothing sent, its
        decode told). The first call starts the thread; from then on it owns the channels and the
        engine (:mod:`.progress_thread`), and :meth:`send` is ``submit(...).result()``.

        Example::

            handle = prefill.submit(transfers, mode="staged", timeout=30)
            ...
            for done in prefill.completed():
                failed = {r: why for r, why in done.result().items() if why}
        """
        self._check_send(transfers, mode, layers)
        transfers = tuple(transfers)
        handle = SendHandle([t.request for t in transfers])
        self.start()
        self._thread.submit(handle, transfers, mode, timeout, layers)
        return handle

    def start(self) -> None:
        """Start the progress thread now rather than at the first :meth:`submit` (for an endpoint that
        takes its decode endpoints later with :meth:`add_peer`, which then pairs on that thread and
        returns at once). :meth:`accept` and :meth:`warm_up` must come before."""
        if self._thread is None:
            self._thread = ProgressThread(self, self.max_in_flight)

    def completed(self) -> list[SendHandle]:
        """The submitted batches that ended since the last call (each once), in the order they ended."""
        done = []
        while self._thread is not None and self._thread.completed:
            done.append(self._thread.completed.popleft())
        return done

    def writes_in_flight(self) -> bool:
        """Whether a batch's writes may be in flight now (its progress thread moves one)."""
        return self._thread is not None and self._thread.moving()

    def in_flight(self) -> int:
        """Submitted batches queued or moving now."""
        return self._thread.in_flight() if self._thread is not None else 0

    def close(self) -> None:
        """Stop the progress thread (after the batch it is moving, if any); the endpoint sends no more."""
        if self._thread is not None:
            self._thread.close()

    def send(self, transfers: Sequence[Transfer], mode: str = "auto", timeout: float = 30.0,
             layers: LayerStreaming | None = None) -> dict[Any, str | None]:
        """Plan and move a batch; returns, per request, ``None`` when sent or the failure reason. It
        waits for the batch: a scheduler's thread submits instead (:meth:`submit`). On an endpoint
        that has a progress thread it is ``submit(...).result()``; on one that never submitted it runs
        on the caller's thread.

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
        if self._thread is not None:
            return self.submit(transfers, mode, timeout, layers).result()
        self._check_send(transfers, mode, layers)
        return drive(self._start_send(tuple(transfers), mode, timeout, layers), engine_fds(self.engine))

    def _check_send(self, transfers: Sequence[Transfer], mode: str, layers: LayerStreaming | None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if layers is not None and mode == "prepared":
            raise ValueError("prepared lists cannot stream in layer groups; use direct, staged or auto")
        if (mode == "prepared" or layers is not None) and any(self.peers[t.dest].integrity for t in transfers):
            raise ValueError("a decode endpoint asked for checksums (integrity=True), which need a plan's descriptors "
                             "and every byte written when it is planned: send direct, staged or auto, without layer "
                             "streaming (kvplan.transport.integrity)")

    def _start_send(self, transfers: tuple[Transfer, ...], mode: str, timeout: float,
                    layers: LayerStreaming | None, submitted: float | None = None) -> Moving:
        """The batch planned and posted: its writes in flight, as a :class:`~.runtime.moving.Moving` whose
        result counts it (:meth:`~.stats.EndpointStats.sent`) when first read; its requests' latency counts
        from ``submitted`` where it waited in the queue first."""
        started = time.monotonic() if submitted is None else submitted
        self.last_nbytes = 0
        try:
            with self._streaming(layers):
                moving = self._send(transfers, mode, timeout, layers)
        except PlanError as err:
            self._stats.failed(f"batch refused: {err}", len({t.request for t in transfers}))
            raise
        nbytes = self.last_nbytes

        def counted(result: dict[Any, str | None]) -> dict[Any, str | None]:
            self._stats.sent(transfers, result, time.monotonic() - started, nbytes)
            return result

        return then(moving, counted)

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
              layers: LayerStreaming | None) -> Moving:
        self.sending.times = [("send", time.perf_counter())]  # the first steps of a staged trace
        transfers = tuple(transfers)
        batch = Batch(self.side, tuple(p.side for p in self.peers), transfers, self.policy)
        refused: dict[Any, str] = {}
        ahead = launched = chunks_run = None
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
                self.sending.times.append(("launched", time.perf_counter()))
                if layers is None:
                    ahead = self._gather_ahead(pending, batch, mode)
                    launched = self._launch_ahead(pending, batch, mode)
                    self.sending.times.append(("queued", time.perf_counter()))
            if chunks_run is not None and "byte_offsets" in pending.planner.outputs:
                # a receiver-planned run: its byte counts come with the plan's report; its descriptors
                # stay on the device, and its sections unread, unless the run needs them after all (PlannedBatch)
                descs, per_transfer, sections = None, pending.transfer_rows(), None
                nbytes = int(pending.section_byte_ends()[-1])
            else:
                descs, per_transfer = pending.descriptors()
                sections, nbytes = pending.sections(), int(descs[:, 2].sum(dtype=np.uint64))
            self.last_nbytes = nbytes
            self.sending.times.append(("planned", time.perf_counter()))
        except PlanError as err:
            self._cancel_chunks(chunks_run, f"batch refused: {err}")
            for t in transfers:
                self._report(t.dest, t.request, f"batch refused: {err}")
            raise
        if not transfers:
            return Done(dict(refused))
        sums = self._checksums(transfers, pending, per_transfer, nbytes)
        if layers is not None:
            staged = mode == "staged" or mode == "auto" and self._auto_mode(len(descs), nbytes) == "staged"
            on_device = (pending.device_descriptors(), self._alignment(batch)) \
                if staged or self.engine.capabilities.device else None
            moved = streamed.send(self.sending, transfers, descs, sections, layers, time.monotonic() + timeout,
                                  on_device if staged else None, None if staged else on_device)
            return Done({**moved, **refused})
        if sums is not None:  # before the bytes: the decode checks a request as soon as it has landed
            self._send_checksums(transfers, sums)
        moving = self._move(transfers, mode, pending, PlannedBatch(transfers, descs, per_transfer, sections, None,
                                                                   ahead=ahead, chunks_run=chunks_run, nbytes=nbytes,
                                                                   pending=pending, launched=launched), batch, timeout)
        return then(moving, lambda moved: {**moved, **refused}) if refused else moving

    def _checksums(self, transfers: tuple[Transfer, ...], pending, per_transfer: np.ndarray,
                   nbytes: int) -> torch.Tensor | None:
        """Each transfer's checksum, launched behind the plan, where a peer of the batch asked for them
        (:mod:`.integrity`); ``None`` where none did."""
        if not any(self.peers[t.dest].integrity for t in transfers):
            return None
        return transfer_sums(pending.device_descriptors(), per_transfer, nbytes,
                             keys=[self._checksum_key(t) for t in transfers])

    def _checksum_key(self, t: Transfer) -> tuple[int, int] | None:
        """The key of ``t``'s request's checksum: from the secret its decode paired with, for that decode's
        incarnation (:func:`.auth.checksum_key`); ``None`` (unkeyed) without a secret."""
        channel = self.peers[t.dest].channel
        secret, receiver = getattr(channel, "secret", None), getattr(channel, "peer_incarnation", None)
        if not self.peers[t.dest].integrity or secret is None or receiver is None:
            return None
        return checksum_key(secret, receiver, t.request)

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
                self.peers[t.dest].channel.send(Kind.CHECKSUM, {"request": t.request, "sum": total}, timeout=ACK_S)
            except KvplanError as err:  # its decode side is gone or stuck: it cannot complete the request anyway
                log.warning("request %r: its checksum could not be sent: %s", t.request, err)

    def _move(self, transfers: tuple[Transfer, ...], mode: str, pending, planned: PlannedBatch, batch: Batch,
              timeout: float) -> Moving:
        deadline = time.monotonic() + timeout
        count = int(planned.per_transfer[-1])
        if mode == "auto":
            mode = self._auto_mode(count, planned.nbytes)
        self.sending.last_mode = mode
        if mode == "direct" and self.engine.capabilities.device:  # the next launch ahead's copy shape
            self._device_typical = max(1, planned.nbytes // max(1, count))
        if mode != "staged":
            self._cancel_chunks(planned.chunks_run, f"sent {mode}")
        log.info("sending %d transfers (%d descriptors) %s", len(transfers), count, mode)
        return SENDERS[mode](self.sending, transfers, planned, pending, batch, deadline)

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
        """``auto``'s choice for a batch of ``count`` descriptors moving ``nbytes``: direct where the engine
        writes from the plan's device descriptors in one launch (the ``ipc`` engine: no host step per
        descriptor for staging to save)."""
        if self.engine.capabilities.device:
            return "direct"
        if self.staging is None or any(p.staging is None for p in self.peers) or not self.staging.is_cuda:
            return "direct"  # (on the CPU the gather and scatter kernels run interpreted: far slower)
        return "staged" if count >= AUTO_MIN_DESCS and nbytes <= AUTO_MAX_AVG_BYTES * count else "direct"
