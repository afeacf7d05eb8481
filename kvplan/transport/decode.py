"""The receiving side of a hand-off: registration, destination lists, staged waves, completion.

:class:`DecodeEndpoint` registers its pools with the engine and publishes its layout, then, per request, its
destination lists (SGLang's wire format). Completion comes from the engine's notifications (direct and prepared
modes) or from staged waves. A staged run is announced on the control channel ahead of its bytes, either by its
chunks alone (the endpoint plans the scatter from what it published, :mod:`.receiver_plan`) or with the sender's
destination table (checked against what it published, :mod:`.landing`). The engine's notification says a wave
has landed; the endpoint scatters it on its own stream and returns the slot's credit once the scatter has
finished. It never spins: it blocks in one wait on its sockets, engine and caller's wake-up (:mod:`.runtime.loop`).

Example::

    decode = DecodeEndpoint(side, make_engine("nixl", "decode"), ControlChannel(host="127.0.0.1"))
    decode.register()
    decode.publish([PreallocatedRequest("r1", row=1, prompt_len=4096)], timeout=30)
    states = decode.wait()                    # {"r1": "complete"} or "failed"; settled requests are pruned
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .. import env
from ..errors import LayoutError
from ..planner.device.destinations import PreallocatedRequest, PublishedRequest, plan_destinations, request_segments
from ..planner.device.planner import Planner
from ..planner.contract.batch import Batch, SideMemory
from ..planner.contract.pairing import pair_sides
from ..planner.contract.tensor_slices import partner_rank
from .decode_messages import SenderMessages
from .decode_thread import DecodeProgress
from .decode_warm import DecodeWarmUp
from .completion import CompletionTracker
from .control import MAX_REFUSED, ControlChannel, ControlTimeout
from .copy_graphs import CopyGraphs, copy_graphs_enabled
from .engines import Engine
from .landing import LandingGuard
from .local import plan_alignment, warm_up
from .pause import Pause
from .runtime.loop import engine_fds
from .receiver_plan import OwnLists, PlannedRun
from .receivers.staged import POLL_S, StagedReceiver, _StagedWave
from .streams import caller_event, transport_stream
from .registration import describe_side
from .control_messages import Kind

__all__ = ["DecodeEndpoint", "engine_regions"]

log = logging.getLogger(__name__)



def _peers(peer: int | Sequence[int]) -> tuple[int, ...]:
    peers = (int(peer),) if isinstance(peer, (int, np.integer)) else tuple(int(k) for k in peer)
    if not peers or len(set(peers)) != len(peers):
        raise ValueError(f"a request is published to one sender or to several distinct ones, not {peer!r}")
    return peers


def engine_regions(side: SideMemory) -> list[tuple[int, int]]:
    """The ``(address, bytes)`` regions an engine registers for ``side``: its entries' spans, where two overlap
    (entries over the same memory: vLLM overlays its KV cache groups) one region over both, so that no byte is
    registered twice."""
    entries = list(side.kv.entries) + [e for c in side.state for e in c.entries] + list(side.aux)
    spans = sorted((e.base_ptr, e.base_ptr + e.item_len * e.num_items) for e in entries if e.num_items)
    regions: list[list[int]] = []
    for start, end in spans:
        if regions and start < regions[-1][1]:
            regions[-1][1] = max(regions[-1][1], end)
        else:
            regions.append([start, end])
    return [(start, end - start) for start, end in regions]


class DecodeEndpoint(SenderMessages, StagedReceiver, DecodeWarmUp):
    """The receiving side (see the module docstring).

    ``channels``: one control channel per prefill endpoint that sends here (fan-in); a request is
    published to one of them (``publish(..., peer=k)``) and only that sender may write it, or, gathered
    from a larger TP size, to the source ranks that together hold this rank's part (``publish(...,
    peer=[k0, k1])``, docs/tp_state.md §4): each of them must then land its whole part.

    ``on_complete``: called with the requests that have just completed (every byte landed, and checked
    where integrity is on) before any of them is reported complete, on the progress thread once the
    endpoint is started (else in :meth:`poll`): where an integration moves bytes on from kvplan's buffers
    (SGLang's aux rows out of their device mirror, :mod:`kvplan.integrations.sglang.aux_mirror`). What
    it raises fails those requests with its error.
    """

    def __init__(self, side: SideMemory, engine: Engine, channels: ControlChannel | Sequence[ControlChannel],
                 staging: torch.Tensor | None = None, integrity: bool = False, compat: str | None = None,
                 senders: int | None = None, on_complete: Callable[[list[Any]], None] | None = None):
        env.validate()  # every KVPLAN_* variable set here, checked once, before anything starts
        self.side, self.engine, self.staging = side, engine, staging
        self.on_complete = on_complete
        # what the sender must match beyond the layout it can check (an integration's own word for the bytes'
        # meaning, such as vLLM's physical KV layout); sent with the registration, compared there
        self.compat = compat
        # per-request checksums (.integrity): asked of every sender; a request completes once its bytes agree
        self.integrity = integrity
        self._sums: dict[Any, dict[int, int]] = {}  # request -> each sender's checksum as it came
        self.channels = list(channels) if isinstance(channels, (list, tuple)) else [channels]
        # (senders: made with no channel yet, its memory registered before any is asked for: attach_channels)
        self._sender_count = len(self.channels) if senders is None else senders
        self._sender_slots = len(self.channels)  # sender indices given (add_sender), counted on the caller's side
        self.tracker = CompletionTracker(side)
        self.guard = LandingGuard(side)
        self.failures: dict[Any, str | None] = {}
        self._owner: dict[Any, tuple[int, ...]] = {}  # request -> the channels (senders) it was published to
        # aborted or failed requests: per sender it was published to, whether that sender can no longer
        # write into it (None: not known yet; False: a write it could not end); see fenced()
        self._fences: dict[Any, dict[int, bool | None]] = {}
        self._senders: dict[int, SideMemory] = {}  # each paired sender's layout (its "paired" message)
        self._refused: dict[int, str] = {}  # senders that refused the pairing: why (requests published to them fail)
        self._engine_names: dict[int, str] = {}  # each paired sender's engine name (whence its notifications)
        self.notes_refused = 0  # engine notifications refused: unsealed, sealed by no pairing held, or replayed (_opened)
        # per paired sender whose staged runs this side plans itself: the side it plans them from
        # (receiver_plan.scatter_source: this side, or the sender's mirror), and for a mirror its
        # planner and copy word (made on the sender's first run)
        self._scatter_from: dict[int, SideMemory] = {}
        self._mirrors: dict[int, tuple[Planner, int]] = {}
        self._credit_to: dict[int, str] = {}  # senders that take staged credits as engine notifications: their name
        self._waves: dict[str, _StagedWave] = {}
        self._checked = 0.0  # when deadlines were last looked at (time.monotonic)
        self._pause = Pause(fds=engine_fds(engine))  # between two looks of wait() and of its progress thread
        self._early: dict[str, float] = {}  # waves whose bytes landed before their table was read: when
        self._uploads: dict[int, tuple[torch.Tensor, Any]] = {}  # per sender: pinned rows, their last upload
        self._own: dict[Any, OwnLists] = {}  # what planned runs are planned from, per request published with a row
        self._runs: list[tuple[int, PlannedRun]] = []  # planned runs whose scatter is not yet known, by sender
        # runs announced by their chunks, by (sender, run id), until their waves come: the run, or why it was refused
        self._chunked: dict[tuple[int, int], PlannedRun | str] = {}
        self._planner: Planner | None = None  # plans planned runs' scatters (this side to itself)
        self._alignment = plan_alignment(Batch(side, (side,), ()))  # caps a planned run's announced alignment
        table = side.req_to_token  # where this side's pools live (its checksums run there)
        self._device = table.device if isinstance(table, torch.Tensor) else torch.device("cpu")
        self.trace: list[tuple[str, str, float]] | None = [] if env.enabled("KVPLAN_TRACE") else None
        # high priority: a scatter is short and the request waits on it; it must not queue behind a forward pass
        self._stream = transport_stream(staging.device) if staging is not None and staging.is_cuda else None
        # a short table run's scatters are captured as CUDA graphs when announced, ahead of their bytes: a
        # landing then replays one graph instead of launching the kernel from the host (docs/layerwise.md §3)
        self._graphs = self._stream is not None and env.enabled("KVPLAN_SCATTER_GRAPHS")
        self._capture_stream = transport_stream(staging.device) if self._graphs else None
        # each is uploaded to the device once captured, not at its one replay (KVPLAN_UPLOAD_GRAPHS=0: not)
        self._upload = env.enabled("KVPLAN_UPLOAD_GRAPHS")
        # a one-wave planned run's scatter reads its plan's buffers, which recur with the planner's slots
        self._copy_graphs = CopyGraphs(transport_stream(staging.device)) \
            if self._stream is not None and copy_graphs_enabled() else None
        self._share = (staging.numel() // max(1, self._sender_count)) // 256 * 256 if staging is not None else 0
        # senders whose process ended (their end of the control connection closed), as of the last look: their
        # fences hold (a sender that went silent is not among them)
        self._gone_senders: set[int] = set()
        self._gone_seen: dict[int, float] = {}  # sender -> when its connection was first seen lost (GONE_GRACE_S)
        self._sender_inc: dict[int, str | None] = {}  # each sender's incarnation as it paired
        # senders paired again after a silence: the incarnation before (a resumed one says its writes ended)
        self._resuming: dict[int, str | None] = {}
        self._progress: DecodeProgress | None = None  # the progress thread, once start()ed
        self.engine.register(engine_regions(side) + ([(staging.data_ptr(), staging.numel())] if staging is not None else []))
        if staging is not None and staging.is_cuda:  # (the interpreter compiles nothing: nothing to warm off a GPU)
            warm_up(staging)

    def start(self) -> None:
        """Hand the endpoint to its own progress thread (:mod:`.decode_thread`): from now on
        :meth:`publish`, :meth:`abort`, :meth:`refuse`, :meth:`forget` and :meth:`poll` return in
        microseconds (they launch, enqueue or read), and engine notifications, staged waves, deadlines
        and fences progress without any call of the caller's. Call it after :meth:`register` (and
        :meth:`warm_up`), which talk on the caller's thread; :meth:`close` stops it.

        Example::

            decode.register(); decode.start()
            decode.publish(requests, timeout=30)        # returns once the kernels are launched
            ended = decode.poll()                       # {request: None or the reason}
        """
        if self._progress is None:
            self._progress = DecodeProgress(self)

    def close(self) -> None:
        """Stop the progress thread (queued aborts and forgets run first)."""
        if self._progress is not None:
            self._progress.close()

    def wait_ended(self, timeout: float) -> bool:
        """On a started endpoint, block up to ``timeout`` seconds until a request has ended (what
        :meth:`poll` would return); whether one has. For a caller that has nothing else to do."""
        if self._progress is None:
            raise RuntimeError("wait_ended() needs the progress thread: call start() first")
        return self._progress.wait_ended(timeout)

    def _before_thread(self, call: str) -> None:
        if self._progress is not None:
            raise RuntimeError(f"{call}() talks on the caller's thread: call it before start(), which gives the "
                               "channels to the progress thread")

    def _threaded(self, action) -> bool:
        """Enqueue ``action`` for the progress thread if the caller is another thread; whether it was."""
        if self._progress is None or self._progress.here():
            return False
        self._progress.call(action)
        return True

    def attach_channels(self, channels: Sequence[ControlChannel]) -> None:
        """The channels of an endpoint made with ``senders=n`` and none: its engine's memory is registered
        at construction, which may take seconds (a cold device), and a prefill's listener closes a
        channel whose registration does not follow its request within a bound. Call :meth:`register`
        next.

        Example::

            decode = DecodeEndpoint(side, engine, [], staging=staging, senders=2)  # the slow part first
            decode.attach_channels([channel_via(host, port + r, timeout=5) for r in (0, 1)])
            decode.register(timeout=5)
        """
        self._before_thread("attach_channels")
        if self._sender_slots or len(channels) != self._sender_count:
            raise LayoutError(f"this decode endpoint was made for {self._sender_count} senders and has {len(self.channels)} "
                              f"channels: it takes {self._sender_count} once, not {len(channels)}")
        self.channels = list(channels)
        self._sender_slots = len(self.channels)

    def register(self, timeout: float = 60.0) -> None:
        """Publish this side's layout, engine metadata and staging buffer; waits up to ``timeout``
        seconds for the prefill side to connect."""
        self._before_thread("register")
        deadline = time.monotonic() + timeout
        for k in range(len(self.channels)):
            self._register(k, deadline)

    def _register(self, peer: int, deadline: float) -> None:
        """Send sender ``peer`` this side's layout, engine metadata and its share of the staging buffer."""
        share = [self.staging.data_ptr() + peer * self._share, self._share] if self.staging is not None else None
        header = {"side": describe_side(self.side), "staging": share, "notifies": self.engine.capabilities.notifies,
                  "integrity": self.integrity}
        if self.compat is not None:
            header["compat"] = self.compat
        if len(self.channels) > 1:  # the sender names itself by it in its notifications
            header["peer"] = peer
        self.channels[peer].send(Kind.REGISTER, header, self.engine.metadata(),
                                 timeout=max(0.0, deadline - time.monotonic()))

    def add_sender(self, channel: ControlChannel, timeout: float) -> int:
        """Take one more sender (a prefill rank found later, such as another prefill node's) and
        register this side with it; returns its peer index. With a staging buffer, split into shares for
        ``senders`` senders at construction, a sender past that count is refused. On a started endpoint
        the registration is sent from the progress thread (the index is known at once); a registration
        that cannot be sent fails every request published to that sender with the reason.

        Example::

            decode = DecodeEndpoint(side, engine, [], staging=staging, senders=4)
            decode.start()
            peer = decode.add_sender(channel_via(host, port, timeout=5), timeout=5)
        """
        if self.staging is not None and self._sender_slots >= self._sender_count:
            raise LayoutError(f"this decode endpoint's staging buffer is split among {self._sender_count} senders, "
                              "all taken: make it with senders= as many as it may serve")
        peer, deadline = self._sender_slots, time.monotonic() + timeout
        self._sender_slots += 1
        if not self._threaded(lambda: self._attach_sender(channel, peer, deadline)):
            self._attach_sender(channel, peer, deadline)
        return peer

    def _attach_sender(self, channel: ControlChannel, peer: int, deadline: float) -> None:
        self.channels.append(channel)  # (senders are attached in the order their indices were given)
        try:
            self._register(peer, deadline)
        except ControlTimeout as err:
            if self._progress is None:
                raise
            self._refused[peer] = f"this side's registration could not be sent to sender {peer}: {err}"
            log.warning("%s", self._refused[peer])
            self._fail_owned(peer, self._refused[peer])

    def abort(self, request: Any, reason: str) -> None:
        """Fail ``request`` here and tell each sender it was published to, which then sends none of it
        that it has not posted yet; its lists stop being writable (the landing guard forgets them).
        Writes already posted may still land: the request's pages are free for reuse only once
        :meth:`fenced` says so (each sender has acknowledged the abort, reported the request failed
        with its writes ended, or is gone)."""
        if self._threaded(lambda: self.abort(request, reason)):
            return
        acks = self._fence_of(request)
        for k in [k for k, ok in acks.items() if ok is None]:  # (aborted again: only those yet to answer)
            try:
                self.channels[k].send(Kind.ABORT, {"request": request, "reason": reason}, timeout=POLL_S)
            except ControlTimeout as err:
                log.warning("request %r: the abort could not be sent to sender %d: %s", request, k, err)
        if request in self.tracker:
            self.tracker.fail(request, reason)

    def refuse(self, request: Any, reason: str, peer: int = 0) -> None:
        """Tell sender ``peer`` that ``request``, which this side never published, will not be: it must
        not wait for its lists (an admission bound, such as a full queue: ``reason`` says which). The
        sender keeps it in :attr:`PrefillEndpoint.refused`. Nothing of it is tracked here, and nothing
        is acknowledged (no page of it exists to fence). Several at once: :meth:`refuse_all`.

        Example::

            decode.refuse("req-9", "overload: 64 requests wait for a row here")
        """
        self.refuse_all([request], reason, peer)

    def refuse_all(self, requests: Sequence[Any], reason: str, peer: int = 0) -> None:
        """:meth:`refuse` for every request of ``requests`` in one control message (an overloaded
        decode refuses thousands a second: one message each, and an acknowledgement each, took the
        sender's thread from its batches).

        Example::

            decode.refuse_all(["req-9", "req-10"], "overload: 64 requests wait for a row here")
        """
        requests = list(requests)
        if not requests:
            return
        if len(requests) > MAX_REFUSED:
            raise ValueError(f"at most {MAX_REFUSED} requests are refused in one call, got {len(requests)}")
        if self._threaded(lambda: self.refuse_all(requests, reason, peer)):
            return
        try:
            self.channels[peer].send(Kind.REFUSE, {"requests": requests, "reason": reason}, timeout=POLL_S)
        except ControlTimeout as err:
            log.warning("%d requests (%r first): the refusal could not be sent to sender %d: %s", len(requests),
                        requests[0], peer, err)
        self.tracker.stats.failed(reason, len(requests))

    def fenced(self, request: Any) -> bool:
        """Whether no write into ``request``'s pages can still land: every sender it was published to
        acknowledged its abort with nothing in flight, or reported it failed once its writes had
        ended, or closed its end of the control connection (its process ended: a dead sender writes
        nothing more), or paired again saying that its earlier writes had all ended. A sender that
        went silent (stopped, hung, cut off) is not fenced by its silence: its writes may still land
        when it resumes (docs/failures.md §10). False for a request none of them has answered for."""
        acks = self._fences.get(request)
        if acks is None:
            return False
        if self._progress is not None and not self._progress.here():  # (the channels are the thread's)
            gone = self._progress.gone
            return all(ok or k in gone for k, ok in list(acks.items()))
        return all(ok or self._ended(k) for k, ok in acks.items())

    def _ended(self, k: int) -> bool:
        """Whether sender ``k`` is gone with its process (its end of the connection closed)."""
        channel = self.channels[k]
        return channel.peer_gone() and getattr(channel, "lost_by", "closed") == "closed"

    def _fence_of(self, request: Any) -> dict[int, bool | None]:
        """Per sender ``request`` was published to, whether it can no longer write into it (None: not
        known yet); made at its abort or at a sender's report of its failure."""
        return self._fences.setdefault(request, {k: None for k in self._owner.get(request, ())})

    def forget_fence(self, request: Any) -> None:
        """Drop what :meth:`fenced` keeps of ``request`` (its pages were released)."""
        if self._threaded(lambda: self.forget_fence(request)):
            return
        self._fences.pop(request, None)

    def forget(self, request: Any) -> None:
        """Drop everything this endpoint keeps of a settled ``request``: its tracking, the lists it
        published, who may write it and its fence. Call it once the request's pages were released
        (for a failed one: once :meth:`fenced`); a long-running endpoint then keeps nothing of it."""
        if self._threaded(lambda: self.forget(request)):
            return
        if request in self.tracker:
            self.tracker.forget(request)
        self.guard.forget(request)
        self._owner.pop(request, None)
        self._own.pop(request, None)
        self._fences.pop(request, None)
        self._sums.pop(request, None)

    def footprint(self) -> dict[str, int]:
        """How many entries each of this endpoint's per-request and per-wave tables holds (what
        ``kvplan load`` watches for growth)."""
        return {"tracked": len(self.tracker), "published": len(self.guard), "owners": len(self._owner),
                "own_lists": len(self._own), "fences": len(self._fences), "waves": len(self._waves),
                "early_waves": len(self._early), "runs": len(self._runs) + len(self._chunked), "checksums": len(self._sums)}

    def stats(self) -> dict[str, Any]:
        """The operator's counters (:mod:`.stats`): requests by outcome (``complete``, ``failed``), the
        bytes of completed requests, failures by cause, the latency from publish to decode-ready
        (p50, p99 in ms, over the latest requests), requests in flight and bounds hit.

        Example::

            decode.stats()["latency_ms"]["p99"]
        """
        return self.tracker.stats.snapshot(in_flight=self.tracker.in_flight)

    def totals(self) -> dict[str, Any]:
        """:meth:`stats`' cumulative counters alone, without percentiles (cheap: an engine's step may ask)."""
        return self.tracker.stats.totals()

    @property
    def channel(self) -> ControlChannel:
        """The first (usually the only) sender's channel."""
        return self.channels[0]

    def publish(self, requests: Sequence[PreallocatedRequest], timeout: float, peer: int | Sequence[int] = 0,
                publishers: int = 1) -> None:
        """Compute, validate and send every request's destination lists to sender ``peer`` (or to
        each of several senders it is gathered from, see the class docstring); track them.
        ``publishers``: how many decode endpoints publish each of these requests to that sender (the
        ranks of a decode of a larger TP size that one prefill rank serves); the sender goes on once
        all have (:meth:`PrefillEndpoint.published_by_all`)."""
        peers, deadline = _peers(peer), time.monotonic() + timeout
        if self._progress is not None:  # checked here; the thread launches a turn's publishes together
            request_segments(self.side, requests)
            self._progress.publish(requests, deadline, peers, publishers, caller_event(self.side.req_to_token))
            return
        self._finish_publish(plan_destinations(self.side, requests), requests, deadline, peers, publishers)

    def _finish_publish(self, pending: Any, requests: Sequence[PreallocatedRequest], deadline: float,
                        peers: tuple[int, ...], publishers: int) -> None:
        self._finish_published(pending.result(), pending.messages(), requests, deadline, peers, publishers)

    def _finish_published(self, published: Sequence[PublishedRequest], messages: Sequence[bytes],
                          requests: Sequence[PreallocatedRequest], deadline: float, peers: tuple[int, ...],
                          publishers: int) -> None:
        """Track published requests and send each one's lists (``messages``) to its senders."""
        self.track(published, deadline, peers)
        for r, p in zip(requests, published):
            self._own[r.request] = OwnLists.of(r, p)
        for r, message in zip(requests, messages):
            header = {"request": r.request, "prompt_len": r.prompt_len, "prefix_len": r.prefix_len, "plans": True,
                      **({"publishers": publishers} if publishers > 1 else {})}
            for k in peers:
                self._send_request(k, r.request, header, message, deadline)

    def _send_request(self, k: int, request: Any, header: dict[str, Any], message: bytes, deadline: float) -> None:
        """Send a request's lists to sender ``k``, or fail the request naming why. A lost sender's channel is
        not waited on: a send would wait for a new peer until the deadline, holding up every other request."""
        try:
            if self.channels[k].peer_gone():
                raise ControlTimeout("its control connection is lost (the sender ended or went silent)")
            self.channels[k].send(Kind.REQUEST, header, message, timeout=max(0.0, deadline - time.monotonic()))
        except ControlTimeout as err:
            self.tracker.fail(request, f"its destination lists could not be published to sender {k}: {err}")

    def track(self, published: Sequence[PublishedRequest], deadline: float, peer: int | Sequence[int] = 0) -> None:
        """Expect the published requests (lists computed by :func:`plan_destinations` or by the
        caller) from sender ``peer``, or from each of several it is gathered from: their completion
        is tracked, and those peers may write only inside their lists. A gather waits (until
        ``deadline``) for its senders' layouts, and raises :class:`~kvplan.errors.LayoutError` unless
        they are exactly the source ranks that hold this rank's part."""
        if self._threaded(lambda: self.track(published, deadline, peer)):
            return
        peers = _peers(peer)
        parts = self._gather_parts(peers, deadline) if len(peers) > 1 else None
        for p in published:
            self.guard.publish(p.request, p.lists, p.aux_index)
            starts, ends = self.guard.ranges(p.request)
            self.tracker.expect(p.expectation(), deadline, parts, verify=self.integrity,
                                nbytes=int((ends - starts).sum()))
            self._owner[p.request] = peers
            refused = next((self._refused[k] for k in peers if k in self._refused), None)
            if refused is not None:  # (its sender refused the pairing before: nothing of it can come)
                self.tracker.fail(p.request, refused)

    def publish_lists(self, published: Sequence[PublishedRequest], prefix_lens: Sequence[int], timeout: float,
                      peer: int | Sequence[int] = 0, publishers: int = 1) -> None:
        """Publish destination lists the caller made itself (an engine's own page lists rather than
        planning rows): track each request, then send its lists to sender ``peer`` (or to each sender
        it is gathered from). ``prefix_lens``: per request, the tokens the decode holds already
        (its lists start after them). On a started endpoint it returns at once; the progress thread
        tracks and sends, in the order published. A list that cannot be sent fails its request.

        Example::

            lists = PublishedRequest(room, DestinationLists(pages, ()), aux_index, (), True)
            decode.publish_lists([lists], prefix_lens=[0], timeout=30, peer=k)
        """
        deadline = time.monotonic() + timeout
        if self._threaded(lambda: self._send_lists(published, prefix_lens, deadline, peer, publishers)):
            return
        self._send_lists(published, prefix_lens, deadline, peer, publishers)

    def _send_lists(self, published: Sequence[PublishedRequest], prefix_lens: Sequence[int], deadline: float,
                    peer: int | Sequence[int], publishers: int) -> None:
        peers = _peers(peer)
        self.track(published, deadline, peers)
        page_size = self.side.kv.page_size
        for p, prefix_len in zip(published, prefix_lens):
            header = {"request": p.request, "prompt_len": int(prefix_len) + len(p.lists.pages) * page_size,
                      "prefix_len": int(prefix_len), **({"publishers": publishers} if publishers > 1 else {})}
            message = p.message()
            for k in peers:
                self._send_request(k, p.request, header, message, deadline)

    def _writes(self, request: Any, peer: int) -> bool:
        """Whether sender ``peer`` may write ``request``."""
        return peer in self._owner.get(request, ())

    def _gather_parts(self, peers: tuple[int, ...], deadline: float) -> dict[int, frozenset[str]]:
        """For a request gathered from ``peers``: the components each writes (a source rank whose
        pairing slices nothing of a component sends none of it), once every sender's layout is known;
        raises unless the senders are exactly the source ranks that hold this rank's part."""
        self._poll()  # (what has arrived is read before the deadline is judged: a late caller still sees it)
        while (missing := [k for k in peers if k not in self._senders]):
            if time.monotonic() > deadline:
                raise ControlTimeout(f"senders {missing} have not paired with this side: a request gathered from "
                                     "them cannot be tracked")
            self.channels[missing[0]].wait_readable(min(POLL_S, max(0.0, deadline - time.monotonic())))
            self._poll()
        kv, sides = self.side.kv, [self._senders[k] for k in peers]
        sizes = sorted({s.kv.tp_size for s in sides})
        if len(sizes) != 1 or sizes[0] <= kv.tp_size or sizes[0] % kv.tp_size:
            raise LayoutError(f"a request published to {len(peers)} senders is gathered from one larger TP size; the "
                              f"senders have TP sizes {sizes}, this side TP {kv.tp_size} (docs/tp_state.md §4)")
        want = [r for r in range(sizes[0]) if partner_rank(r, sizes[0], kv.tp_size) == kv.tp_rank]
        got = [s.kv.tp_rank for s in sides]
        if sorted(got) != want:
            raise LayoutError(f"rank {kv.tp_rank} of TP {kv.tp_size} gathers from ranks {want} of TP {sizes[0]}, but "
                              f"the senders hold ranks {got}: part of its items would never be written")
        parts = {}
        for k, sender in zip(peers, sides):
            pairing = pair_sides(sender, self.side)
            parts[k] = frozenset(c.name for c, table in zip(self.side.state, pairing.state_src) if len(table))
        return parts

    # -- progress ---------------------------------------------------------------------------------
    def poll(self) -> dict[Any, str | None]:
        """Take in what has arrived: engine notifications, wave tables, failures; apply deadlines.

        Returns the requests that ended since the last call, each once: ``None`` for one that is
        complete (decode-ready), else the reason it failed. A caller reads what ended from here, not
        by asking every tracked request (:attr:`tracker` still answers for one). On a started
        endpoint it only reads what the progress thread found."""
        if self._progress is not None:
            return self._progress.take_ended()
        self._poll()
        return self._finished(self.tracker.take_ended())

    def _finished(self, ended: dict[Any, str | None]) -> dict[Any, str | None]:
        """``ended`` after :attr:`on_complete` has run over its completed requests (each failed with the
        hook's error where it raised)."""
        done = [r for r, why in ended.items() if why is None]
        if self.on_complete is None or not done:
            return ended
        try:
            self.on_complete(done)
        except Exception as err:  # noqa: BLE001 - an integration's hook: its error fails its requests, named
            reason = f"every byte landed, but on_complete failed: {type(err).__name__}: {err}"
            log.error("requests %s: %s", done[:8], reason)
            ended.update((r, reason) for r in done)
            for r in done:  # (whoever asks the tracker later hears it failed too: wait(), fences)
                self.tracker.fail_completed(r, reason)
        return ended

    def wait(self) -> dict[Any, str]:
        """Progress until every published request is complete or failed (each has its deadline).

        Returns the states; the reasons of failures are in :attr:`failures`. Settled requests are
        pruned from the tracker and the landing guard.
        """
        if self._progress is not None and not self._progress.here():
            return self._wait_started()
        while True:
            self.poll()
            if self.tracker.settled():
                states = self.tracker.states()
                self.failures = {r: self.tracker.failure(r) for r in states}
                for r in states:
                    self.tracker.forget(r)
                    self.guard.forget(r)
                    self._owner.pop(r, None)
                    self._own.pop(r, None)  # (its fence stays: the caller releases its pages once fenced)
                for key in [k for k, w in self._waves.items() if w.event is None and not w.landed
                            and all(r not in self._owner for r in w.requests)]:
                    del self._waves[key]  # announced for requests that have failed: it will never be scattered
                self._chunked = {key: run for key, run in self._chunked.items()  # (waves that never came)
                                 if isinstance(run, PlannedRun) and any(r in self._owner for r in run.requests)}
                self._mark("-", "settled")
                return states
            self._pause(self.channels)  # blocks on the channels and the engine for one slice (.pause)

    def _wait_started(self) -> dict[Any, str]:
        """``wait()`` on a started endpoint: until the thread has finished every publish and settled
        every tracked request, then the same pruning, run there."""
        ended: dict[Any, str | None] = {}
        while self._progress.pending_publishes() or not self.tracker.settled():
            self._progress.wait_ended(0.05)
            ended.update(self._progress.take_ended())
        ended.update(self._progress.take_ended())
        done = threading.Event()
        result: dict[str, Any] = {}
        self._progress.call(lambda: (result.update(states=self.wait()), done.set()))
        if not done.wait(60.0):
            raise ControlTimeout("the decode endpoint's progress thread did not answer within 60 s")
        states = {r: ("complete" if why is None else "failed") for r, why in ended.items()}
        states.update(result["states"])
        self.failures = {**{r: why for r, why in ended.items()}, **self.failures}
        return states
