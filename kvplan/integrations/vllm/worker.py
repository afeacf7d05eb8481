"""The worker side of kvplan's vLLM connector: vLLM's KV blocks moved through kvplan's endpoints.

Each TP rank of an engine runs one :class:`ConnectorWorker`. It sees vLLM's KV tensors once
(:meth:`register_kv_caches`, :mod:`.kv_caches`) and then, every step, what the scheduler side decided
(:class:`~.scheduler.SchedulerStep`):

* **sending** (a prefill): a kvplan :class:`~kvplan.transport.prefill.PrefillEndpoint` listens at
  ``host:port + rank`` for decodes (:class:`~kvplan.transport.listener.ChannelListener`). A finished
  request's blocks go into a row of its planning table; once the decode that took the request has
  published its blocks for it, the step's ready requests are planned as one batch and written
  (:meth:`get_finished`). A request is reported finished sending, so that vLLM frees its blocks, once
  its writes have ended (sent or failed), once its decode gave it up, or once ``timeout_s`` passed
  with no decode asking for it;
* **receiving** (a decode): one kvplan :class:`~kvplan.transport.decode.DecodeEndpoint` per prefill
  rank it receives from (the same rank of an engine of the same TP size), each with its engine and
  staging buffer, publishes the blocks vLLM allocated, under the prefill's request id. A request is
  reported finished receiving once every byte landed; a failed one (its prefill failed it, died, or
  missed ``timeout_s``) is aborted, reported once no write into its blocks can still land
  (:meth:`DecodeEndpoint.fenced`), in ``failed_recving`` and, where the model has one KV cache group,
  with its blocks in :meth:`get_block_ids_with_load_errors`: never as a success.

Both sides lay blocks out alike or do not pair: the endpoints compare :attr:`BlockView.word` (dtype,
what a head's token holds, the groups), and kvplan's pairing the rest (heads and tokens in order, block and
TP sizes). A model's sliding-window KV cache groups move as SWA state: each request's window blocks, reached
through a map from the full-attention group's slots (:mod:`.windows`); its Mamba groups as Mamba state: each
request's state block, through a map by planning row (:mod:`.state_slots`), each tensor of its page sliced by
TP rank where kvplan knows the kind's sharding (:mod:`.mamba_shards`), else between equal TP sizes.
Planning runs on the KV tensors' device (the GPU in a deployment). How a prefill writes is the ``mode`` setting: on GPUs ``auto`` gathers small
blocks into a staging buffer and writes a few large pieces (``staged``), else one write per run of
blocks that are neighbours on both sides (``direct``).

Example (what vLLM's model runner does each step)::

    worker = ConnectorWorker(settings, engine_id="decode-0", tp_rank=0, tp_size=1, block_size=16)
    worker.register_kv_caches(kv_caches)
    worker.start_load_kv(step)                       # the scheduler side's SchedulerStep
    results = worker.get_transfer_results(finished_req_ids)
    bad_blocks = worker.get_block_ids_with_load_errors()
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ...errors import InputError, KvplanError
from ...planner.contract.block_tables import token_table_from_blocks
from ...planner.device.destinations import PreallocatedRequest
from ...transport.auth import channel_secret
from ...transport.decode import DecodeEndpoint
from ...transport.engines import make_engine
from ...transport.listener import AddressInUse, ChannelListener
from ...transport.prefill import Chunk, PrefillEndpoint
from .counters import counted, interval_counts
from .groups import KVGroup
from .decode_pairing import HANDSHAKE_S, REGISTER_S, PrefillLinks
from .kv_caches import BlockView
from .scheduler import ReceiveRequest, SchedulerStep, SendRequest, UnsupportedConfig
from .settings import Settings
from .planning_rows import PlanningRows
from .state_slots import StateSlots
from .windows import WindowMaps

__all__ = ["ConnectorWorker", "TransferResults"]

log = logging.getLogger(__name__)

FINISHED_GRACE = 16  # results calls a finished id that is no send here is kept (vLLM names a send's id in its step)

_NO_ROW = -1  # (a request that waits for a planning row: every row is in flight)

# batches a prefill worker keeps moving at once (below its endpoint's max_in_flight, which would refuse more with
# "overload"); requests ready meanwhile go together in the next batch
MOVING_MAX = 2


@dataclass
class TransferResults:
    """One step's report to vLLM's scheduler (its ``KVConnectorTransferResults``)."""

    finished_sending: set[str]
    finished_recving: set[str]
    failed_recving: set[str]


@dataclass
class _Sending:
    """A finished prefill request whose blocks wait for its decode's lists."""

    request: SendRequest
    row: int
    deadline: float
    moving: bool = False  # in a submitted batch: its row and blocks are read until that batch ends
    given_up: str | None = None  # its decode gave it up while it moved: settled once the batch ends


@dataclass
class _Receiving:
    """A decode request published to its prefill, under the prefill's request id."""

    local_id: str
    row: int
    block_ids: list[int]
    endpoint: DecodeEndpoint  # the one paired with its prefill rank
    failed: str | None = None  # why, once it failed (it is reported once fenced)


class ConnectorWorker:
    """One TP rank's worker side (see the module docstring)."""

    def __init__(self, settings: Settings, engine_id: str, tp_rank: int, tp_size: int, block_size: int,
                 max_model_len: int = 1 << 17, sends: bool = True, receives: bool = True,
                 groups: Sequence[KVGroup] = ()):
        self.settings, self.engine_id = settings, engine_id
        # off loopback with no secret and no opt-out, the worker stops here, saying so (SettingError)
        channel_secret(settings.listen.host, settings.secret(), insecure=settings.insecure)
        # (the full-attention group's block size plans the KV; the engine's --block-size where vLLM names none)
        full = next((g for g in groups if not g.window and not g.mamba), None)
        block_size = (full.block_size if full is not None else 0) or block_size
        self.tp_rank, self.tp_size, self.block_size = tp_rank, tp_size, block_size
        self.width = -(-max_model_len // block_size) * block_size  # planning-table columns (tokens)
        self.sends, self.receives, self.groups = sends, receives, tuple(groups)
        # (a request's block lists are in vLLM's group order: the full-attention group's plans, the others map)
        self.full_group = next((i for i, g in enumerate(self.groups) if not g.window and not g.mamba), 0)
        self.window_groups = [i for i, g in enumerate(self.groups) if g.window]
        self.mamba_groups = [i for i, g in enumerate(self.groups) if g.mamba]
        self._send_maps: WindowMaps | None = None
        self._recv_maps: WindowMaps | None = None
        self._send_states: StateSlots | None = None
        self._recv_states: StateSlots | None = None
        self.view: BlockView | None = None
        self.prefill: PrefillEndpoint | None = None
        self.listener: ChannelListener | None = None
        # the decode endpoints, by prefill (host, port, ranks): paired, pairing, and those whose prefill is gone
        self.links = PrefillLinks(self._decode_endpoint, self._release, settings, tp_rank)
        self._engines: list[Any] = []
        self._sending: dict[str, _Sending] = {}
        self._sent: set[str] = set()  # written (or given up), waiting for vLLM to name them finished
        # requests vLLM said finished (finished_req_ids) not yet reported sent, with the results call that said it:
        # vLLM names every finished request, most of which this worker never sends (kept a few calls, then dropped)
        self._finished: dict[str, int] = {}
        self._calls = 0  # get_transfer_results calls so far
        self._receiving: dict[str, _Receiving] = {}  # by the prefill's request id
        self._load_errors: set[int] = set()
        self._unpublished: list[tuple[str, list[int]]] = []  # requests refused before publication, and their blocks
        # each direction's planning rows and the requests waiting for one (sized at registration, for a side
        # that sends or receives)
        self._send_rows = self._recv_rows = PlanningRows(1)
        self._reported: dict[str, Any] | None = None  # the counters as the last interval_stats saw them

    # -- registration ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Take vLLM's KV tensors; a sending worker starts listening for decodes."""
        self.view = BlockView.of_groups(kv_caches, self.groups, self.block_size)
        self.device = next(iter(kv_caches.values())).device
        windows = [window for window, _ in self.view.windows]
        window_blocks = [view.block_size for _, view in self.view.windows]
        if self.sends:
            self._send_table = torch.zeros((self.settings.max_requests + 1, self.width), dtype=torch.int32,
                                           device=self.device)
            self._send_rows = PlanningRows(self.settings.max_requests + 1)
            self._send_maps = WindowMaps(windows, self.view.num_blocks, self.block_size, self.device, window_blocks)
            self._send_states = StateSlots(len(self.view.mambas), self.settings.max_requests + 1, self.device)
            side = self.view.side(self._send_table, self.tp_size, self.tp_rank, self._send_maps.maps,
                                  self._send_states.maps)
            self.prefill = PrefillEndpoint(side, self._engine("send"), [], staging=self._staging(), refuse="request",
                                           compat=self.view.word)
            if self.settings.warm_up:  # (each decode that pairs is warmed as it pairs)
                self.prefill.warm_up(**self.settings.warm_up, timeout=HANDSHAKE_S)
            # its progress thread pairs, plans and moves; the model runner's thread submits and reads what ended
            self.prefill.start()
            self._submitted: dict[Any, list] = {}  # handle -> its chunks
            listen = self.settings.listen
            try:
                self.listener = ChannelListener(listen.port + self.tp_rank, host=listen.host, handshake_s=REGISTER_S,
                                                secret=self.settings.secret(), insecure=self.settings.insecure)
            except AddressInUse as err:
                raise UnsupportedConfig(
                    f"kv_connector_extra_config: rank {self.tp_rank} listens at port {listen.port} + {self.tp_rank}, "
                    f"but {err}. Two engines on one host (a prefill and a decode) need ports whose ranges "
                    f"(port .. port + TP size - 1) do not overlap, or the decode kv_role kv_consumer, which listens "
                    "on none (docs/vllm.md, Deploying)") from None
            log.info("kvplan's vLLM connector, rank %d: %d blocks of %d layers; decodes connect at %s:%d", self.tp_rank,
                     self.view.num_blocks, len(self.view.layers), listen.host, listen.port + self.tp_rank)
        if self.receives:
            self._recv_table = torch.zeros((self.settings.max_requests + 1, self.width), dtype=torch.int32,
                                           device=self.device)
            self._recv_rows = PlanningRows(self.settings.max_requests + 1)
            self._recv_maps = WindowMaps(windows, self.view.num_blocks, self.block_size, self.device, window_blocks)
            self._recv_states = StateSlots(len(self.view.mambas), self.settings.max_requests + 1, self.device)

    def _engine(self, role: str) -> Any:
        memory = "VRAM" if self.device.type == "cuda" else "DRAM"
        settings = dict(self.settings.engine_settings)
        if self.settings.engine == "mooncake":  # peers reach its segment at this worker's address unless told otherwise
            settings.setdefault("local_hostname", self.settings.listen.host)
        engine = make_engine(self.settings.engine, f"vllm-{self.engine_id}-{role}-{self.tp_rank}-{os.getpid()}", memory,
                             self.device.index or 0, **settings)
        self._engines.append(engine)
        return engine

    def interval_stats(self) -> dict[str, Any] | None:
        """What this worker's endpoints counted since the last call (``None`` when nothing): the payload of
        vLLM's connector stats (:mod:`.connector_stats`). A few dictionary reads per endpoint."""
        endpoints = ([self.prefill] if self.sends and self.prefill is not None else []) + list(self.links.decodes.values())
        now = interval_counts([e.totals() for e in endpoints] + self.links.retired.totals())
        before, self._reported = self._reported, now
        if before is None:
            delta = now
        else:
            delta = {k: now[k] - before.get(k, 0) for k in now if k != "failures"}
            delta["failures"] = {c: n - before["failures"].get(c, 0) for c, n in now["failures"].items()
                                 if n - before["failures"].get(c, 0)}
        return delta if counted(delta) else None

    # -- each step ------------------------------------------------------------------------------------
    def start_load_kv(self, step: SchedulerStep) -> None:
        """Take the step's decisions: finished prefill requests to send, decode requests to publish.
        Pairing with a prefill not met before runs on a thread of its own: its requests are published
        once it is paired, a later step (the step never waits for a handshake)."""
        self.links.take_pairings(self._publish_to, self._fail_waiting)
        now = time.monotonic()
        sends = []
        for request_id, (send, deadline) in self._send_rows.in_order(step.send, now, self.settings.timeout_s):
            row = self._take_send(request_id, send)
            if row == _NO_ROW:
                self._wait_for_row(self._send_rows, request_id, send, deadline, now)
            elif row is not None:
                sends.append((request_id, send, row, deadline))
        if sends:  # (the step's rows written at once: one copy to the device and one expansion)
            self._write_rows(self._send_table, [(row, 0, send.block_ids[self.full_group]) for _, send, row, _ in sends])
            self._send_maps.flush()
            self._send_states.flush()
        for request_id, send, row, deadline in sends:
            self._sending[request_id] = _Sending(send, row, deadline)
        admitted = []
        for request_id, (receive, deadline) in self._recv_rows.in_order(step.receive, now, self.settings.timeout_s):
            try:
                row = self._admit(request_id, receive)
                if row == _NO_ROW:
                    self._wait_for_row(self._recv_rows, request_id, receive, deadline, now)
                elif row is not None:
                    admitted.append((request_id, receive, row))
            except KvplanError as err:
                self._fail_unpublished(request_id, receive, f"{type(err).__name__}: {err}")
        if admitted:
            self._write_rows(self._recv_table, [(row, r.prefix_len, r.block_ids[self.full_group])
                                                for _, r, row in admitted])
            self._recv_maps.flush()
            self._recv_states.flush()
        for request_id, receive, row in admitted:
            try:
                self._publish(request_id, receive, row)
            except KvplanError as err:
                self._recv_rows.give(row)
                self._recv_maps.release(receive.remote_request_id)
                self._fail_unpublished(request_id, receive, f"{type(err).__name__}: {err}")

    def _wait_for_row(self, rows: PlanningRows, request_id: str, request: Any, deadline: float, now: float) -> None:
        """``request`` found every planning row in flight: it waits for one until its deadline, then fails (a
        send is freed unsent, its decode failing it at its own deadline; a load is reported failed, with its
        blocks, and its prefill told that none of it is needed)."""
        if rows.wait(request_id, request, deadline, now):
            return
        why = (f"it waited {self.settings.timeout_s} s for one of the {self.settings.max_requests} planning rows "
               "(max_requests), all in flight")
        if isinstance(request, SendRequest):
            log.error("request %s was not sent: %s; its blocks are freed unsent", request_id, why)
            self._sent.add(request_id)
            return
        decode = self.links.live(self._key(request)) if request.remote_host is not None else None
        if decode is not None:
            self.links.none_needed(decode, request.remote_request_id)
        self._fail_unpublished(request_id, request, f"KvplanError: {why}")

    def get_transfer_results(self, finished_req_ids: set[str]) -> TransferResults:
        """Move what is ready and report what ended: the requests whose blocks vLLM may free (sent,
        among those it named finished), received, and failed to receive."""
        self._calls += 1
        for request_id in finished_req_ids:
            self._finished.setdefault(request_id, self._calls)
        self.links.take_pairings(self._publish_to, self._fail_waiting)
        if self.prefill is not None:
            self._progress_sends()
        received, failed = self._progress_receives()
        for request_id, blocks in self._unpublished:
            failed.add(request_id)
            self._load_errors.update(blocks)
        self._unpublished = []
        sent = self._sent & self._finished.keys()
        self._sent -= sent
        for request_id in sent:
            del self._finished[request_id]
        self._forget_finished()
        return TransferResults(sent, received | failed, failed)

    def _forget_finished(self) -> None:
        """Drop the finished ids that are no send of this worker's once ``FINISHED_GRACE`` calls have passed
        (one named before its send was taken is kept until then): 100,000 finished requests left 100,000 ids."""
        if len(self._finished) <= len(self._sending) + len(self._sent) + len(self._send_rows.waiting):
            return  # (all of them may be sends: nothing to look at)
        oldest = self._calls - FINISHED_GRACE
        self._finished = {r: at for r, at in self._finished.items()
                          if at > oldest or r in self._sending or r in self._sent or r in self._send_rows.waiting}

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks of requests reported failed since the last call (one KV cache group only: vLLM maps
        block ids back to requests only then; with several, ``failed_recving`` alone says it)."""
        errors, self._load_errors = self._load_errors, set()
        return errors if len(self.groups) <= 1 else set()

    def shutdown(self) -> None:
        """Close every channel, the listener and the engines (idempotent)."""
        closers = [self.listener.close] if self.listener is not None else []
        if self.prefill is not None:  # its progress thread first: it owns the channels and the engine
            closers += [self.prefill.close] + [p.channel.close for p in self.prefill.peers]
        closers += self.links.close()  # (a handshake in progress ends within its bound)
        closers += [e.close for e in self._engines]
        self.listener = self.prefill = None
        self._engines = []
        for close in closers:
            try:
                close()
            except Exception as err:  # noqa: BLE001 - a resource already gone: nothing left to release
                log.warning("closing kvplan's vLLM connector: %s: %s", type(err).__name__, err)

    # -- sending --------------------------------------------------------------------------------------
    def _take_send(self, request_id: str, send: SendRequest) -> int | None:
        """The planning row of a finished prefill request, ``_NO_ROW`` where every row is in flight, or
        ``None`` (its blocks are freed unsent, logged)."""
        blocks = send.block_ids[self.full_group] if len(send.block_ids) > self.full_group else []
        why = ("a prefill request on a worker that does not send (kv_role)" if self.prefill is None else
               None if blocks else "it has no blocks")
        if why is None and len(blocks) * self.block_size > self.width:
            why = f"{len(blocks) * self.block_size} tokens exceed the planning table's {self.width} (max_model_len)"
        if why is None:
            why = self._send_maps.claim(request_id, blocks, [send.block_ids[g] for g in self.window_groups], 0,
                                        send.num_tokens)
        row = self._send_rows.take() if why is None else None
        if why is None and row is None:
            self._send_maps.release(request_id)
            return _NO_ROW
        if row is not None and (why := self._send_states.put(row, [send.block_ids[g] for g in self.mamba_groups])):
            self._send_maps.release(request_id)
            self._send_rows.give(row)
            row = None
        if row is None:
            log.error("request %s: %s; its blocks are freed unsent", request_id, why)
            self._sent.add(request_id)
        return row

    def _progress_sends(self) -> None:
        endpoint = self.prefill
        for channel in self.listener.accept_pending():  # (paired on the progress thread once it registers)
            endpoint.add_peer(channel, HANDSHAKE_S)
        try:
            endpoint.progress()
        except KvplanError as err:
            log.warning("a decode could not pair with rank %d: %s", self.tp_rank, err)
        given_up = [r for _, r, _ in endpoint.aborted] + [r for _, r in endpoint.given_up]
        endpoint.aborted.clear()
        endpoint.given_up.clear()
        for request_id in given_up:
            sending = self._sending.get(request_id)
            if sending is not None and sending.moving:
                sending.given_up = "its decode gave it up"
            elif sending is not None:
                self._done_sending(request_id, "its decode gave it up")
        for handle in endpoint.completed():
            sent = self._submitted.pop(handle)
            try:
                results = handle.result(timeout=0)
            except KvplanError as err:
                results = {t.request: f"{type(err).__name__}: {err}" for t in sent}
            for request_id in dict.fromkeys(chunk.request for chunk in sent):
                sending = self._sending[request_id]
                self._done_sending(request_id, results.get(request_id) or sending.given_up)
                endpoint.forget([request_id])
        if len(self._submitted) >= MOVING_MAX:
            return  # (what is ready meanwhile goes together in the next batch)
        now, chunks = time.monotonic(), []
        for request_id, sending in list(self._sending.items()):
            if sending.moving:
                continue
            peers = [k for k, p in enumerate(endpoint.peers) if request_id in p.lists]
            if not peers or not endpoint.published_by_all(request_id):  # (a decode of a larger TP: each rank's heads)
                if now > sending.deadline:
                    self._done_sending(request_id, f"no decode asked for it within {self.settings.timeout_s} s"
                                       if not peers else f"{len(peers)} of its {endpoint.publishers[request_id]} "
                                       f"decode ranks asked for it within {self.settings.timeout_s} s")
                    endpoint.forget([request_id])
                continue
            try:  # (an abort read on the progress thread may drop its lists at any moment: it is read next step)
                mine = []
                for k in peers:  # its decode's pages must hold tokens [prefix, num_tokens): refused alone otherwise
                    prefix, prompt_len = endpoint.peers[k].lists[request_id][2], sending.request.num_tokens
                    mine.append(endpoint.transfer(Chunk(request_id, sending.row, prefix, prompt_len, prompt_len, True),
                                                  peer=k))
            except (KeyError, InputError):
                continue
            chunks += mine
        if not chunks:
            return
        self._submitted[endpoint.submit(chunks, mode=self.settings.mode, timeout=self.settings.timeout_s)] = chunks
        for request_id in dict.fromkeys(chunk.request for chunk in chunks):
            self._sending[request_id].moving = True

    def _done_sending(self, request_id: str, reason: str | None) -> None:
        sending = self._sending.pop(request_id)
        self._send_rows.give(sending.row)
        self._send_maps.release(request_id)
        self._sent.add(request_id)
        if reason is not None:
            log.warning("request %s was not sent: %s", request_id, reason)

    # -- receiving ------------------------------------------------------------------------------------
    def _admit(self, request_id: str, receive: ReceiveRequest) -> int | None:
        """The planning row of a decode request to publish, after checking what it says (raises
        ``KvplanError`` naming what is wrong); ``_NO_ROW`` where every row is in flight; ``None`` for one
        with nothing to load, whose prefill is told to free its blocks."""
        remote = receive.remote_request_id
        if len(receive.block_ids) <= self.full_group or not receive.block_ids[self.full_group]:
            # nothing to load (vLLM aborted it before its blocks came, and has freed it): its prefill frees its
            # blocks. Never reported, whatever happens: vLLM holds no such request any more, and a report of it
            # failed its scheduler's assertion and took the decode's engine core down
            if self.receives and remote is not None and receive.remote_host is not None \
                    and receive.remote_port is not None:
                try:
                    decode = self.links.endpoint(receive.remote_host, receive.remote_port, self._prefill_ranks(receive))
                except KvplanError as err:  # (its prefill frees them at its own deadline)
                    log.warning("request %s: could not tell its prefill that no block of it is needed: %s",
                                request_id, err)
                    return None
                if decode is None:  # (told once it is paired)
                    self.links.pairings[self._key(receive)].none_needed.append(remote)
                else:
                    self.links.none_needed(decode, remote)
            return None
        if not self.receives:
            raise KvplanError("this worker does not receive (kv_role kv_producer)")
        if remote is None or receive.remote_host is None or receive.remote_port is None:
            raise KvplanError("its kv_transfer_params name no prefill (remote_request_id, remote_host, remote_port)")
        self._prefill_ranks(receive)  # (raises where its prefill's TP size cannot serve this rank)
        blocks = receive.block_ids[self.full_group]
        needed = -(-receive.num_tokens // self.block_size)
        if len(blocks) != needed or receive.prefix_len % self.block_size:
            raise KvplanError(f"{len(blocks)} blocks after a prefix of {receive.prefix_len} tokens for "
                              f"{receive.num_tokens} tokens of blocks of {self.block_size}")
        if receive.prefix_len + len(blocks) * self.block_size > self.width:
            raise KvplanError(f"{receive.prefix_len + len(blocks) * self.block_size} tokens exceed the planning "
                              f"table's {self.width} (max_model_len)")
        if remote in self._receiving:
            raise KvplanError(f"its prefill's request id {remote!r} is already being received here")
        why = self._recv_maps.claim(remote, blocks, [receive.block_ids[g] for g in self.window_groups],
                                    receive.prefix_len, receive.num_tokens)
        if why is not None:
            raise KvplanError(why)
        row = self._recv_rows.take()
        if row is None:
            self._recv_maps.release(remote)
            return _NO_ROW
        why = self._recv_states.put(row, [receive.block_ids[g] for g in self.mamba_groups])
        if why is not None:
            self._recv_rows.give(row)
            self._recv_maps.release(remote)
            raise KvplanError(why)
        return row

    def _prefill_tp(self, receive: ReceiveRequest) -> int:
        """The TP size of the request's prefill (this decode's own where its parameters name none)."""
        return int(receive.remote_tp_size) if receive.remote_tp_size is not None else self.tp_size

    def _prefill_ranks(self, receive: ReceiveRequest) -> tuple[int, ...]:
        """The prefill ranks that hold this rank's heads of the request (``KvplanError`` where none can): the
        same rank at equal TP; at a prefill TP ``P`` smaller than this decode's ``D``, rank ``r * P // D``,
        which serves ``D // P`` decode ranks; at a larger one, ranks ``r * k .. r * k + k - 1`` with
        ``k = P // D``, each writing its heads (a gather)."""
        prefill_tp = self._prefill_tp(receive)
        if prefill_tp == self.tp_size:
            return (self.tp_rank,)
        if any(not self.groups[g].shards for g in self.mamba_groups):
            raise KvplanError(f"its prefill runs TP {prefill_tp}, this decode TP {self.tp_size}: kvplan's connector "
                              "moves Mamba state of this kind between equal TP sizes only (it knows Mamba1's, "
                              "Mamba2's and GDN's sharding)")
        if not self.view.slices_heads:
            raise KvplanError(f"its prefill runs TP {prefill_tp}, this decode TP {self.tp_size}: blocks that do not "
                              "hold one layer's heads and tokens (a layout other than LBNHC or LBHNC) move between "
                              "equal TP sizes only")
        if prefill_tp < self.tp_size and self.tp_size % prefill_tp == 0:
            return (self.tp_rank * prefill_tp // self.tp_size,)
        if prefill_tp > self.tp_size and prefill_tp % self.tp_size == 0:
            k = prefill_tp // self.tp_size
            return tuple(range(self.tp_rank * k, self.tp_rank * k + k))
        raise KvplanError(f"its prefill runs TP {prefill_tp}, this decode TP {self.tp_size}: one must divide the other")

    def _key(self, receive: ReceiveRequest) -> tuple[str, int, tuple[int, ...]]:
        return (receive.remote_host, int(receive.remote_port), self._prefill_ranks(receive))

    def _decode_endpoint(self, senders: int) -> DecodeEndpoint:
        """A decode endpoint over this worker's receiving table, with an engine and a staging buffer of its own."""
        return DecodeEndpoint(self.view.side(self._recv_table, self.tp_size, self.tp_rank, self._recv_maps.maps,
                                             self._recv_states.maps),
                              self._engine("receive"), [], staging=self._staging(), compat=self.view.word,
                              senders=senders, integrity=self.settings.integrity)

    def _release(self, decode: DecodeEndpoint) -> None:  # (one that did not pair goes, with its engine)
        self._engines.remove(decode.engine)
        decode.engine.close()

    def _fail_waiting(self, request_id: str, receive: ReceiveRequest, row: int, reason: str) -> None:
        self._recv_rows.give(row)  # (admitted, its row taken, and not published: reported failed)
        self._recv_maps.release(receive.remote_request_id)
        self._fail_unpublished(request_id, receive, reason)

    def _publish(self, request_id: str, receive: ReceiveRequest, row: int) -> None:
        """Publish an admitted request's blocks (its row written) to the decode endpoint paired with the
        prefill ranks that hold this rank's heads, with the number of decode ranks each serves."""
        decode = self.links.endpoint(receive.remote_host, receive.remote_port, self._prefill_ranks(receive))
        if decode is None:  # published once paired (PrefillLinks.take_pairings)
            self.links.pairings[self._key(receive)].waiting.append((request_id, receive, row))
            return
        self._publish_to(decode, request_id, receive, row)

    def _publish_to(self, decode: DecodeEndpoint, request_id: str, receive: ReceiveRequest, row: int) -> None:
        ranks = self._prefill_ranks(receive)
        decode.publish([PreallocatedRequest(receive.remote_request_id, row, receive.prefix_len + receive.num_tokens,
                                            receive.prefix_len)], timeout=self.settings.timeout_s,
                       peer=list(range(len(ranks))), publishers=max(1, self.tp_size // self._prefill_tp(receive)))
        self._receiving[receive.remote_request_id] = _Receiving(request_id, row, list(receive.block_ids[self.full_group]),
                                                                decode)

    def _progress_receives(self) -> tuple[set[str], set[str]]:
        for decode in self.links.endpoints():
            decode.poll()
        received, failed = set(), set()
        for remote, receiving in list(self._receiving.items()):
            decode = receiving.endpoint
            if receiving.failed is None:
                state = decode.tracker.state(remote) if remote in decode.tracker else "failed"
                if state == "pending":
                    continue
                if state == "complete":
                    received.add(receiving.local_id)
                    self._end_receive(remote)
                    continue
                receiving.failed = decode.tracker.failure(remote) if remote in decode.tracker else "not tracked"
                log.warning("request %s (the prefill's %s) failed to load: %s", receiving.local_id, remote,
                            receiving.failed)
                decode.abort(remote, receiving.failed)
            if decode.fenced(remote):  # no write into its blocks can land any more: vLLM may reuse them
                failed.add(receiving.local_id)
                self._load_errors.update(receiving.block_ids)
                self._end_receive(remote)
        if self.links.retired:
            self.links.retired.close_unused({id(r.endpoint) for r in self._receiving.values()}, self._engines)
        return received, failed

    def _end_receive(self, remote: str) -> None:
        receiving = self._receiving.pop(remote)
        self._recv_rows.give(receiving.row)
        self._recv_maps.release(remote)
        receiving.endpoint.forget(remote)

    def _fail_unpublished(self, request_id: str, receive: ReceiveRequest, reason: str) -> None:
        """A request whose blocks could not be published: nothing was written into them; reported failed
        at the next results, with its blocks."""
        log.warning("request %s cannot load from its prefill: %s", request_id, reason)
        blocks = [b for group in receive.block_ids for b in group]
        self._unpublished.append((request_id, blocks))

    # -- helpers --------------------------------------------------------------------------------------
    def _staging(self) -> torch.Tensor | None:
        """A staging buffer of ``staging_mib`` on the KV's GPU (none on a CPU, or with 0: writes go direct)."""
        size = self.settings.staging_mib << 20
        return torch.empty(size, dtype=torch.uint8, device=self.device) if size and self.device.type == "cuda" else None

    def _write_rows(self, table: torch.Tensor, rows: list[tuple[int, int, list[int]]]) -> None:
        """Write each ``(row, prefix, blocks)``: tokens ``[prefix, prefix + len(blocks) * block_size)`` of
        planning row ``row`` become the blocks' slots. One copy of block ids to the device, one expansion and
        one write per distinct prefix (a row's columns past its own blocks get its last block's slots again:
        no plan reads past a request's length). The callers checked every row fits the table."""
        by_prefix: dict[int, list[tuple[int, list[int]]]] = {}
        for row, prefix, blocks in rows:
            by_prefix.setdefault(prefix, []).append((row, blocks))
        for prefix, group in by_prefix.items():
            width = max(len(blocks) for _, blocks in group)
            ids = np.empty((len(group), width), dtype=np.int64)
            for k, (_, blocks) in enumerate(group):
                ids[k, : len(blocks)] = blocks
                ids[k, len(blocks):] = blocks[-1]
            row_ids = np.array([row for row, _ in group], dtype=np.int64)
            both = torch.from_numpy(np.concatenate([row_ids, ids.reshape(-1)])).to(table.device)
            slots = token_table_from_blocks(both[len(group):].view(len(group), width), self.block_size)
            table[both[: len(group)], prefix : prefix + width * self.block_size] = slots
