"""kvplan behind SGLang's disaggregation interfaces: ``KVManager``, ``KVSender``, ``KVReceiver``.

They subclass SGLang's ``BaseKVManager``, ``BaseKVSender`` and ``BaseKVReceiver``, take the same
constructor arguments (``KVArgs``, the disaggregation mode, the server args) and report SGLang's
``KVPoll`` states. Underneath, a prefill manager owns a kvplan :class:`PrefillEndpoint` and a decode
manager a :class:`DecodeEndpoint`: pages are planned by kvplan (on the GPU when there is one) and
moved by kvplan's transport through NIXL or Mooncake.

SGLang's sender is per request: ``init(num_pages, aux_index)``, then ``send(page_ids)`` per chunk.
The prefill manager gathers every ``send`` of one scheduler step and plans them as one batch at the
first ``poll`` after them (or at :meth:`KVManager.flush`): that is where planning on the GPU pays.

Scope of this version: KV pages and aux rows, direct or head-sliced, chunked, with a
decode prefix; the state SGLang hands with the last chunk (``send(pages, state_indices=...)``,
``send_metadata(..., state_indices=...)``), one list per component, mapped onto kvplan's planning
inputs by what the kind's rules say it needs (:mod:`kvplan.planner.contract.state_kinds`):

* a slot per request through a map by row (Mamba): the slot goes into that row of the map;
* pages through a token slot map (SWA): the window's pages SGLang translated go into the map, for
  the request's last pages, so kvplan computes the same window and checks every page of it;
* the request's own pages (DSA): SGLang's list must be exactly the request's pages;
* ring rows (SWA_RING): rows of SGLang's request-pool row, which kvplan's formula reads as the
  planning row, so the request is planned in that row and its list must be the formula's.

The decode side publishes SGLang's lists as they are. What ``KVArgs`` does not hold (an SWA
window, a ring's size) comes per component from the server arg ``kvplan_state_params`` on both
sides. SWA and DSA components are declared ``from_prefix`` (planning.md §6's variant): after a
decode prefix their lists start at the prefix, as SGLang 0.5.23's do. The last chunk's
``num_kv_tokens`` gives the request's true length, which places the SWA window and the ring's.

With the server arg ``kvplan_protocol="sglang"`` a manager speaks SGLang's own protocol (Mooncake or
NIXL) instead. A prefill manager serves SGLang's decode ranks: it registers with SGLang's bootstrap server,
reads SGLang's registrations and transfer requests, and answers each request with SGLang's status
message (:mod:`.decode_ranks`). A decode manager is served by SGLang's prefill: it finds it through the
bootstrap server, registers, asks for each request and reads its status (:mod:`.decode_link`).

Switched on by the plugin (``KVPLAN_SGLANG=1``, :mod:`.plugin`), with kvplan's settings from
``KVPLAN_*`` variables (:mod:`.settings`). A prefill rank binds a control listener on its node's
address (``KVPLAN_HOST``, default SGLang's own choice) and registers it with SGLang's bootstrap server,
which keeps its port; a decode rank finds the prefill's layout there (``try_ensure_parallel_info``),
then the rank that holds its part, and asks its listener for a control channel of its own
(:mod:`kvplan.transport.listener`), all of it off the scheduler's thread (:mod:`.pairing`). Several
decode managers per prefill manager: one step's sends fan out to the decode managers that published
them, planned as one batch; a decode manager pairs with each prefill rank its requests come from. Both endpoints run on progress threads of their own
(docs/sglang.md, "What runs on which thread"): ``poll`` submits and reads, and returns ``Success`` or
``Failed`` for a request whose last chunk has gone. SGLang's ``abort`` on either side fails the
request there and tells the peer; docs/sglang.md lists every call SGLang's schedulers make.

Example (prefill and decode in two processes; ``kv_args`` as SGLang fills them)::

    from sglang.srt.disaggregation.utils import DisaggregationMode
    from kvplan.integrations.sglang.adapter import KVManager, KVReceiver, KVSender

    # prefill
    mgr = KVManager(kv_args, DisaggregationMode.PREFILL, server_args)
    sender = KVSender(mgr, "127.0.0.1:8998", bootstrap_room=7)
    sender.init(num_kv_indices=len(pages), aux_index=3)
    while sender.poll() == KVPoll.Bootstrapping: ...        # until the decode's lists arrived
    sender.send(pages)                                      # the last chunk: all pages
    while sender.poll() not in (KVPoll.Success, KVPoll.Failed): ...

    # decode
    mgr = KVManager(kv_args, DisaggregationMode.DECODE, server_args)
    receiver = KVReceiver(mgr, "127.0.0.1:8998", bootstrap_room=7)
    receiver.init(prefill_dp_rank=0)
    receiver.send_metadata(dst_pages, aux_index=5)
    while receiver.poll() not in (KVPoll.Success, KVPoll.Failed): ...
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any, Optional

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import (
    BaseKVManager,
    BaseKVSender,
    KVPoll,
    KVTransferMetric,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

from ...errors import KvplanError, LayoutError, PeerError
from ...planner.contract.batch import SideMemory
from ...planner.contract.state_kinds import RULES, rules_of
from ...transport.decode import DecodeEndpoint
from ...transport.listener import ChannelListener
from ...transport.memory_kind import memory_kind
from ...transport.engines import TransferError, check_settings, make_engine
from .decode_manager import DecodeManager
from .receiver import KVReceiver, TransferFailed
from .inputs import ids, state_lists
from .mooncake_settings import mooncake_settings
from .prefill_manager import PrefillManager
from ...transport.prefill import PrefillEndpoint
from .decode_ranks import DecodeRanks
from .bootstrap import RankRoute, register_rank
from .aux_mirror import AuxMirror
from .kv_args import aux_from_kv_args, side_from_kv_args, side_from_registration, state_from_kv_args
from .node import attention_tp, bootstrap_host, context_parallel, node_address, parallel_place, server_arg
from .rank_link import PrefillRankLink
from .settings import Settings
from .wire import BACKENDS

__all__ = ["KVManager", "KVReceiver", "KVSender", "TransferFailed"]

log = logging.getLogger(__name__)

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
DEFAULT_CONTEXT = 1 << 17  # planning-table width without a context_length server arg (tokens)
# the state kinds whose lists SGLang starts at the decode prefix (StateComponent.from_prefix)
_FROM_PREFIX_KINDS = frozenset(kind.value for kind, rules in RULES.items() if rules.starts_at_prefix)
HANDSHAKE_S = 5.0  # how long a new decode manager may take to register once it has its channel
RETRY_S = 0.2  # between two tries of a bootstrap server that is not up yet
# SGLang polls every request of its queues in each scheduler step, while the manager's work (channels, ended
# batches, the step's sends as one batch) is the step's: a poll advances it only where nothing else did in
# the last ADVANCE_S and nothing was handed over since (one H100, session 44: the prefill's step spent 0.35 ms
# at the median advancing it once per poll, against 0.06 ms in SGLang's own backends)
ADVANCE_S = 0.0005


def _planning_device() -> torch.device:
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class KVManager(PrefillManager, DecodeManager, BaseKVManager):
    """One side's kvplan endpoint under SGLang's ``BaseKVManager`` (see the module docstring).

    SGLang's server args read (each with a default): ``disaggregation_transfer_backend`` (``"nixl"`` or
    ``"mooncake"``), ``disaggregation_bootstrap_port``, ``host`` and ``dist_init_addr`` (where SGLang's
    bootstrap server is), attention TP (SGLang's runtime context, else ``attn_tp_size``, else ``tp_size``
    over ``dp_size`` with DP attention), ``max_running_requests`` (rows of the planning table),
    ``context_length`` (its width). kvplan's own settings (:class:`~.settings.Settings`: ``KVPLAN_*``
    variables or ``kvplan_*`` server args): ``state_params`` (per state component, what ``KVArgs``
    does not hold: windows, ring sizes), ``mode``, ``timeout_s``, ``engine_settings``
    (a dict for the engine, such as ``{"num_threads": 4}`` or ``{"progress_thread": False}`` for NIXL),
    ``bootstrap``, ``host``, ``protocol`` (``"kvplan"``; or ``"sglang"``, over Mooncake or NIXL: a prefill manager that
    serves SGLang's own decode ranks, registered with SGLang's bootstrap server at ``host`` and
    ``disaggregation_bootstrap_port`` (:mod:`.decode_ranks`; it also needs ``kvplan_decode_lens``, the
    decode's ``kv_data_lens``, ``aux_data_lens`` and ``state_data_lens``, which SGLang's registration
    lacks), or a decode manager served by SGLang's own prefill (:mod:`.decode_link`)). :meth:`close`
    releases the engine and the channels.
    """

    # what SGLang's schedulers read of a manager besides its methods (docs/sglang.md): kvplan runs without
    # context parallelism (refused below) and takes no host destinations
    attn_cp_size, attn_cp_rank = 1, 0
    enable_all_cp_ranks_for_transfer = False
    is_dummy_cp_rank = False
    supports_host_destination = False

    @property
    def enable_deferred_decode_kv_release(self) -> bool:
        """SGLang's decode holds a failed request's pages until :meth:`is_abort_release_safe` (or its
        ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``): kvplan's decode fences them with
        its prefill's acknowledgement of the abort. Not with SGLang's protocol (SGLang's own prefill
        acknowledges in its own format), where the pages are released at once as before."""
        return self.mode is DisaggregationMode.DECODE and self.protocol == "kvplan"

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 1) -> bool:
        """SGLang's decode asks it of a failed request it holds: whether no write into its pages can
        still land (every kvplan sender it was published to acknowledged the abort with nothing in flight,
        or is gone). ``required_acks`` (SGLang's count of its prefill ranks) is not needed: the decode
        endpoint knows each sender of the request. It reads what came first: SGLang asks it of held
        requests while it may poll no receiver at all (every other request concluded), and the
        acknowledgement would sit unread on the channel."""
        if self.decode is None:
            return False
        self.progress()
        return self.decode.fenced(int(bootstrap_room))

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """SGLang released a held request's pages: forget its fence."""
        if self.decode is not None:
            self.decode.forget_fence(int(bootstrap_room))

    def __init__(self, args: Any, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: Optional[bool] = False):
        if context_parallel(server_args) > 1:
            raise LayoutError(f"attention context parallelism (attn_cp_size {context_parallel(server_args)}) is not "
                              "supported by kvplan's SGLang adapter: run without it, or unset KVPLAN_SGLANG")
        self.settings = Settings.read(server_args)
        self.state_params = [dict(p) for p in self.settings.state_params]
        # SGLang's SWA and DSA lists start at the decode prefix (planning.md §6's variant), unless a
        # component's params say otherwise; both sides of the adapter declare it, so they pair
        types = [str(getattr(t, "value", t)) for t in (getattr(args, "state_types", None) or ())]
        self.state_params += [{} for _ in range(len(types) - len(self.state_params))]
        for params, value in zip(self.state_params, types):
            if value in _FROM_PREFIX_KINDS:
                params.setdefault("from_prefix", True)
        try:
            comps = state_from_kv_args(args, self.state_params)
        except LayoutError as err:
            raise LayoutError(f"{err} (the server arg kvplan_state_params gives each state component what KVArgs "
                              "does not hold, such as an SWA window)") from None
        kinds = [c.kind for c in comps]
        paged_apart = [c.name for c in comps if rules_of(c.kind).needs_map and not rules_of(c.kind).map_by_row
                       and c.pages_of(int(args.page_size)) != int(args.page_size)]
        if paged_apart:  # the adapter maps SGLang's window pages onto the KV pages token by token
            raise LayoutError(f"state components {paged_apart}: the adapter maps SWA pages paged like the KV only")
        self.kv_args, self.mode, self.server_args = args, disaggregation_mode, server_args
        self.is_mla = bool(is_mla_backend)
        self.attn_tp_size, self.attn_tp_rank = attention_tp(server_args, args)
        self.page_size = int(args.page_size)
        self.timeout = self.settings.timeout_s
        self.transfer_mode = self.settings.mode
        self.device = _planning_device()
        memory = "VRAM" if self.device.type == "cuda" else "DRAM"
        backend = server_arg(server_args, "disaggregation_transfer_backend", "nixl")
        engine_kind = self.settings.engine or str(getattr(backend, "value", backend))
        self.protocol = self.settings.protocol
        if self.protocol == "sglang" and engine_kind not in BACKENDS:
            raise LayoutError(f"kvplan_protocol='sglang' speaks SGLang's protocol over {list(BACKENDS)}, not "
                              f"{engine_kind}")
        # the staging buffer, made now beside SGLang's pools (mode staged without one is refused)
        staging_bytes = self.settings.staging_bytes(self.device.type, self.protocol)
        self.staging = torch.empty(staging_bytes, dtype=torch.uint8, device=self.device) if staging_bytes else None
        # what this rank binds and advertises, and where SGLang's bootstrap server is (docs/sglang.md)
        self.host = self.settings.host or node_address(server_args)
        self.bootstrap_host = bootstrap_host(server_args)
        self.settings.channel_security(self.host)  # (off loopback with no secret: SettingError, at start)
        engine_settings, where = dict(self.settings.engine_settings), "kvplan's engine_settings"
        if engine_kind == "mooncake":  # the deployment's transport and NICs, as SGLang's own backend takes them
            engine_settings, where = mooncake_settings(server_args, engine_settings, self.host, self.device.index or 0)
            log.info("kvplan's Mooncake engine: %s", where)
        self.engine_kind = engine_kind
        check_settings(engine_kind, engine_settings, where=where)  # (SettingError naming the key, at start)
        try:
            self.engine = make_engine(engine_kind, f"{disaggregation_mode.value}-{os.getpid()}-{id(self):x}", memory,
                                      self.device.index or 0, **engine_settings)
        except TransferError as err:  # (never a silent fallback to another transport)
            raise TransferError(f"{err}; {where}: set it to a transport this machine has (or kvplan's "
                                "engine_settings)") from None
        self.aux_mirror = self._aux_mirror(args, memory, engine_kind)
        self.closed = False
        self.bootstrap_port = int(server_arg(server_args, "disaggregation_bootstrap_port", DEFAULT_BOOTSTRAP_PORT))
        self.status: dict[int, int] = {}
        self.failures: dict[int, str] = {}
        self.broken: str | None = None  # why this manager can send nothing (a refused pairing)
        self._advanced_at, self._handed = float("-inf"), False  # (advance: when a poll last ran progress)
        self.listener: ChannelListener | None = None
        self.ranks: DecodeRanks | None = None  # the SGLang decode ranks served (kvplan_protocol "sglang")
        if disaggregation_mode is DisaggregationMode.PREFILL:
            rows = int(server_arg(server_args, "max_running_requests", 256)) + 1
            width = int(server_arg(server_args, "context_length", min(self._pool_tokens(), DEFAULT_CONTEXT)))
            width = -(-width // self.page_size) * self.page_size
            self.table = torch.zeros((rows, width), dtype=torch.int32, device=self.device)
            # per state component, its map, filled from what SGLang hands with each last chunk: a slot per
            # planning row (by row), or the window's translated slots per token slot of the KV pool
            self.maps = [None if not rules_of(k).needs_map else
                         torch.zeros(rows if rules_of(k).map_by_row else self._pool_tokens(), dtype=torch.int64,
                                     device=self.device) for k in kinds]
            params = [{**p, "slot_map": m} if m is not None else p
                      for p, m in zip(self.state_params + [{}] * (len(kinds) - len(self.state_params)), self.maps)]
            side = self.mirrored(side_from_kv_args(args, mla=self.is_mla, attn_tp_size=self.attn_tp_size,
                                                   req_to_token=self.table, state_params=params))
            self.prefill: PrefillEndpoint | None = PrefillEndpoint(side, self.engine, [], staging=self.staging)
            if self.settings.warm_up:  # each decode that pairs gets a planner ready for these batches (no first-batch stall)
                self.prefill.warm_up(**self.settings.warm_up, timeout=min(5.0, self.timeout))
            # from here its progress thread pairs, plans and moves: the scheduler's thread only submits and reads
            # (with SGLang's protocol, DecodeRanks gives it each decode rank's peer and lists between its batches)
            self.prefill.start()
            self._pending: list[tuple[KVSender, np.ndarray, tuple[np.ndarray, ...] | None, int]] = []
            # sends whose page ids SGLang is still copying off the GPU: (sender, host tensor, its event, state, tokens)
            self._copying: list[tuple[KVSender, Any, Any, tuple[np.ndarray, ...] | None, int]] = []
            # submitted batches not yet ended: each handle's chunks and the planning rows they hold (a row in
            # flight is not rewritten: its batch is planned on the progress thread from the table as it is)
            self._moving: dict[Any, tuple[list, set[int]]] = {}
            if self.protocol == "sglang":  # SGLang's decode ranks find this one through SGLang's bootstrap server
                link = PrefillRankLink(rank_ip=self.host, backend=engine_kind, prefill_rank=int(args.engine_rank))
                self.ranks = DecodeRanks(self.prefill, link, self._decode_side)
            elif self.settings.bootstrap == "direct":  # kvplan's listener is the bootstrap port (no SGLang server)
                self.listener = ChannelListener(self.bootstrap_port, host=self.host, handshake_s=HANDSHAKE_S,
                                                **self.settings.channel_security())
            else:  # a listener of its own, registered with SGLang's bootstrap server, which keeps its port
                self.listener = ChannelListener(0, host=self.host, handshake_s=HANDSHAKE_S, **self.settings.channel_security())
            self.register_to_bootstrap()
        elif disaggregation_mode is DisaggregationMode.DECODE:
            self._init_decode()
        else:
            raise ValueError(f"a KVManager is for PREFILL or DECODE, not {disaggregation_mode}")
        self._counters_at = time.monotonic() + self.settings.stats_s  # when the counters are next logged
        mirror = "none" if self.aux_mirror is None else \
            f"{self.aux_mirror.nbytes / (1 << 20):.1f} MiB of buffers {list(self.aux_mirror.mirrored)}"
        log.info("kvplan's SGLang %s manager: engine %s (%s), mode %s, staging %d MiB, protocol %s, bootstrap %s, "
                 "integrity %s, aux mirror %s", disaggregation_mode.value, engine_kind, memory, self.transfer_mode,
                 staging_bytes >> 20, self.protocol, self.settings.bootstrap,
                 "on" if self.settings.integrity else "off", mirror)

    def _aux_mirror(self, args: Any, memory: str, engine_kind: str) -> AuxMirror | None:
        """The device copy of SGLang's aux buffers that are in host memory beside device pools (kvplan's
        protocol; :mod:`.aux_mirror`). With SGLang's protocol the peer reads and writes SGLang's own
        buffers: none, and over NIXL, which describes a side's memory with one kind, such a manager is
        refused."""
        aux = aux_from_kv_args(args)
        if self.protocol == "kvplan":
            return AuxMirror.for_buffers(aux, self.device, self.settings.aux_mirror)
        host = [i for i, e in enumerate(aux) if memory_kind(e.base_ptr) != memory]
        if host and engine_kind == "nixl":
            raise LayoutError(f"SGLang's aux buffers {host} are in host memory and the KV pools in {memory}: kvplan's "
                              "NIXL engine registers one memory kind, and with kvplan_protocol='sglang' the peer "
                              "addresses SGLang's own buffers; use kvplan's protocol (its aux mirror) or the mooncake "
                              "backend")
        return None

    def mirrored(self, side: SideMemory) -> SideMemory:
        """``side`` with the aux mirror's buffers in place of SGLang's host buffers (as it is without a mirror)."""
        return side if self.aux_mirror is None else replace(side, aux=self.aux_mirror.entries)

    def stats(self) -> dict[str, Any]:
        """kvplan's counters for this manager: its endpoint's (requests by outcome, bytes, failures by
        cause, latency p50 and p99, in flight, bounds hit: :meth:`PrefillEndpoint.stats`,
        :meth:`DecodeEndpoint.stats`) and how many peers it is paired with. A decode served by SGLang's own
        prefill (``protocol`` ``sglang``) has no endpoint: its counters are SGLang's.

        Example::

            mgr.stats()["requests"]          # {"sent": 1200, "failed": 3} on a prefill
        """
        endpoint = self._endpoint()
        if endpoint is None:
            return {}
        peers = len(self.prefill.peers) if endpoint is self.prefill else len(self._senders)
        return {**endpoint.stats(), "peers": peers}

    def _endpoint(self) -> PrefillEndpoint | DecodeEndpoint | None:
        """This manager's kvplan endpoint (none on a decode served by SGLang's own prefill, or once closed)."""
        return self.prefill if self.mode is DisaggregationMode.PREFILL else self.decode

    def _log_counters(self) -> None:
        """Every ``stats_s`` seconds, one INFO line of the endpoint's cumulative counters (cheap: no percentile)."""
        now = time.monotonic()
        if not self.settings.stats_s or now < self._counters_at:
            return
        self._counters_at = now + self.settings.stats_s
        endpoint = self._endpoint()
        if endpoint is None:
            return
        totals = endpoint.totals()
        latency = totals["latency_ms"]
        mean_ms = latency["sum_s"] / latency["count"] * 1e3 if latency["count"] else 0.0
        log.info("kvplan's SGLang %s counters: requests %s, %.1f MiB moved, failures %s, mean request %.2f ms",
                 self.mode.value, totals["requests"], totals["bytes"] / (1 << 20), totals["failures"] or "none", mean_ms)

    def close(self) -> None:
        """Release the engine's registrations and handles, the bootstrap listener and every control
        channel. Idempotent; a closed manager sends and receives nothing. NIXL's agent (and its
        progress thread) ends when the manager is freed.

        Example::

            mgr = KVManager(kv_args, DisaggregationMode.PREFILL, server_args)
            try:
                ...  # the scheduler's loop
            finally:
                mgr.close()
        """
        if self.closed:
            return
        self.closed = True
        closers = []
        if self.mode is DisaggregationMode.PREFILL:
            closers.append(self.listener.close if self.listener is not None else self.ranks.close)
            if self.prefill is not None:  # its progress thread first: it owns the channels and the engine
                closers += [self.prefill.close] + [peer.channel.close for peer in self.prefill.peers]
            self.prefill = None
        else:
            closers = self._close_pairings()
            if self.decode is not None:  # its progress thread first: it owns the channels
                self.decode.close()
                closers += [channel.close for channel in self.decode.channels]
            if self.link is not None:
                closers.append(self.link.close)
            self.decode = self.link = None
        engine, self.engine = self.engine, None
        closers.append(engine.close)  # last, and whatever the others raised
        for close in closers:
            try:
                close()
            except Exception as err:  # noqa: BLE001 - a resource already gone: nothing left to release
                log.warning("closing the SGLang adapter's manager: %s: %s", type(err).__name__, err)

    def _pool_tokens(self) -> int:
        lens = self.kv_args.kv_data_lens
        return int(lens[0] // self.kv_args.kv_item_lens[0]) * self.page_size if lens else self.page_size

    def register_to_bootstrap(self) -> None:
        """Register this prefill rank's control socket and layout with SGLang's bootstrap server (at
        ``bootstrap_host`` and ``disaggregation_bootstrap_port``), as SGLang's prefill does: SGLang's
        protocol's PULL socket, or kvplan's listener. The server may still be starting: tries again until
        the deadline. With ``KVPLAN_BOOTSTRAP=direct``, nothing: the listener is the bootstrap port."""
        if self.mode is not DisaggregationMode.PREFILL or (self.ranks is None and self.settings.bootstrap == "direct"):
            return
        port = self.ranks.link.rank_port if self.ranks is not None else self.listener.port
        route = RankRoute(rank_ip=self.host, rank_port=port, page_size=self.page_size,
                          kv_cache_dtype=str(getattr(self.kv_args, "kv_cache_dtype_str", None) or "auto"),
                          attn_tp_size=self.attn_tp_size, attn_tp_rank=self.attn_tp_rank,
                          **parallel_place(self.server_args, self.kv_args))
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                register_rank(self.bootstrap_host, self.bootstrap_port, route, timeout=max(0.1, min(
                    5.0, deadline - time.monotonic())))
                return
            except KvplanError as err:
                if time.monotonic() + RETRY_S > deadline:
                    raise PeerError(f"this prefill rank could not register with SGLang's bootstrap server at "
                                    f"{self.bootstrap_host}:{self.bootstrap_port} within {self.timeout} s: {err}") \
                        from None
                time.sleep(RETRY_S)

    def _decode_side(self, reg: Any) -> SideMemory:
        """An SGLang decode rank's memory: its registration and the lengths it does not register (the
        server arg ``kvplan_decode_lens``: the decode's ``kv_data_lens``, ``aux_data_lens`` and
        ``state_data_lens``)."""
        if reg.kv_mem_kinds and set(reg.kv_mem_kinds) != {self.engine.memory}:  # (NIXL describes both sides alike)
            raise LayoutError(f"the decode's KV buffers are {sorted(set(reg.kv_mem_kinds))} memory, this side's engine "
                              f"moves {self.engine.memory}")
        try:
            return side_from_registration(reg, self.kv_args, self.settings.decode_lens,
                                          mla=self.is_mla, attn_tp_size=self.attn_tp_size,
                                          state_params=self.state_params)
        except LayoutError as err:
            raise LayoutError(f"{err} (the server arg kvplan_decode_lens gives the decode's buffer lengths)") from None

    # -- prefill --------------------------------------------------------------------------------------
    def paired(self) -> bool:
        return self.prefill is not None and any(p.side is not None for p in self.prefill.peers)

    def advance(self) -> bool:
        """:meth:`progress` for a poll, unless a poll ended it less than :data:`ADVANCE_S` ago and nothing was
        handed over since (``send``); whether it ran. What it would take in waits at most that long."""
        if not self._handed and time.monotonic() - self._advanced_at < ADVANCE_S:
            return False
        self._handed = False
        self.progress()
        self._advanced_at = time.monotonic()
        return True

    def progress(self) -> None:
        """Take in new decode managers, registrations and destination lists (prefill), or
        notifications (decode). A decode side that cannot pair is refused; while no decode side is
        paired, that breaks this manager: every waiting sender fails with the reason."""
        self._log_counters()
        if self.mode is DisaggregationMode.PREFILL and self.ranks is not None:
            published, failed = self.ranks.progress()
            for room, reason in failed:
                self._settle(room, KVPoll.Failed, reason)
            for room in published:  # failed here before its decode rank asked: tell it now
                if self.status.get(room) == KVPoll.Failed:
                    self.ranks.report(room, False, self.failures.get(room))
        elif self.mode is DisaggregationMode.PREFILL:
            for channel in self.listener.accept_pending():  # (paired on the progress thread once it registers)
                self.prefill.add_peer(channel, min(self.timeout, HANDSHAKE_S))
            try:
                self.prefill.progress()
                if self.paired():
                    self.broken = None
            except LayoutError as err:
                reason = f"the decode side cannot pair with this one: {err}"
                log.warning("%s", reason)
                self.broken = None if self.paired() else reason
            aborted, self.prefill.aborted = self.prefill.aborted, []
            for _, room, reason in aborted:
                self._settle(room, KVPoll.Failed, f"the decode side aborted it: {reason}")
        elif self.decode is not None:
            self.take_ended()
        if self.mode is DisaggregationMode.PREFILL and self.prefill is not None:  # (either protocol)
            self._take_completed()

    def abort_room(self, room: int, reason: str) -> None:
        """Fail ``room`` on this side and tell its peers: a prefill drops its unsent chunks and tells each
        decode side that published it; a decode tells its prefill, which sends nothing more of it."""
        self._settle(room, KVPoll.Failed, reason)
        if self.mode is DisaggregationMode.PREFILL and self.prefill is not None:
            self._pending = [x for x in self._pending if x[0].room != room]
            self._copying = [x for x in self._copying if x[0].room != room]
            for k in self._peers_of(room):
                self.prefill.fail([room], reason, peer=k)
        elif self.decode is not None and room in self._room_peer:
            self.decode.abort(room, reason)
        elif self.link is not None and room in self._asked:
            self._asked.pop(room)
            try:
                self.link.abort(room)
            except KvplanError as err:
                log.warning("request %s: the abort could not be sent to SGLang's prefill: %s", room, err)

    def forget_room(self, room: int) -> None:
        """Drop everything this manager keeps of ``room`` (SGLang's ``clear`` once it concluded it)."""
        self.status.pop(room, None)
        self.failures.pop(room, None)
        if self.mode is DisaggregationMode.PREFILL:
            if self.prefill is not None:
                self.prefill.forget([room])
            return
        self._room_peer.pop(room, None)
        self._aux_rows.pop(room, None)
        if self.decode is not None:  # (SGLang clears a held request only once it released its pages)
            self.decode.forget(room)

    def _settle(self, room: int, state: int, reason: str | None = None) -> None:
        if self.status.get(room) == KVPoll.Failed:
            return
        self.status[room] = state
        if reason is not None:
            self.failures[room] = reason
            log.warning("request %s failed: %s", room, reason)
        if self.ranks is not None and state in (KVPoll.Success, KVPoll.Failed):
            self.ranks.report(room, state == KVPoll.Success, reason)


class KVSender(BaseKVSender):
    """One request's sender on the prefill side (SGLang's ``BaseKVSender``)."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False):
        self.mgr, self.room = mgr, int(bootstrap_room)
        self.kv_mgr = mgr  # (SGLang's scheduler reads the sender's manager by this name)
        self.num_pages, self.aux_index, self.pages_sent, self.tokens_sent = 0, 0, 0, 0
        self.pages: list[np.ndarray] = []  # every page sent so far
        self._started = time.monotonic()
        self._first_send: float | None = None  # when the first chunk was handed over, for the transfer metric
        self._concluded: float | None = None

    def pop_decode_prefix_len(self) -> int:
        """The decode side's cached prefix (tokens), from the lists it published: SGLang's prefill starts
        sending there and counts the pages after it (``finalize_bootstrap``)."""
        return self.mgr.decode_prefix_len(self.room)

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        self.num_pages, self.aux_index = int(num_kv_indices), int(aux_index or 0)

    @property
    def supports_host_tensor_indices(self) -> bool:
        """On a GPU, SGLang hands ``send`` the page ids as a pinned host tensor its copy off the GPU is
        still filling, with that copy's CUDA event, rather than syncing its stream for them
        (``send_kv_chunk``); kvplan reads them once the event has passed, asked at each poll and never
        waited for. Off a GPU SGLang hands them as an array."""
        return self.mgr.device.type == "cuda"

    def send(self, kv_indices: Any, state_indices: Optional[list] = None, num_kv_tokens: Optional[int] = None,
             indices_event: Any = None) -> None:
        if self._first_send is None:
            self._first_send = time.monotonic()
        tokens = len(kv_indices) * self.mgr.page_size if num_kv_tokens is None else int(num_kv_tokens)
        if indices_event is not None:  # (its ids are still being copied: read once the event has passed)
            self.mgr.enqueue_copying(self, kv_indices, indices_event, state_lists(state_indices), tokens)
            return
        self.mgr.enqueue(self, ids(kv_indices), state_lists(state_indices), tokens)

    def poll(self) -> int:
        mgr = self.mgr
        if self.room in mgr.status:
            return self._concluding(mgr.status[self.room])
        advanced = mgr.advance()
        if mgr.broken is not None:
            mgr._settle(self.room, KVPoll.Failed, mgr.broken)
        elif advanced:
            mgr.flush()
        if self.room in mgr.status:
            return self._concluding(mgr.status[self.room])
        if not mgr.paired() or not mgr.has_lists(self.room):
            if time.monotonic() - self._started > mgr.timeout:
                mgr._settle(self.room, KVPoll.Failed, "no destination lists from the decode side before the deadline")
                return KVPoll.Failed
            return KVPoll.Bootstrapping
        return KVPoll.Transferring if self.pages_sent else KVPoll.WaitingForInput

    def _concluding(self, state: int) -> int:
        if state in (KVPoll.Success, KVPoll.Failed) and self._concluded is None:
            self._concluded = time.monotonic()
        return state

    def failure_exception(self):
        raise TransferFailed(self.mgr.failures.get(self.room, f"request {self.room} failed"))

    def get_transfer_metric(self) -> KVTransferMetric:
        """The time from the first chunk handed over to the request's conclusion (seconds); bytes are not
        counted per request (a batch's plan moves several requests' bytes together)."""
        if self._first_send is None or self._concluded is None:
            return KVTransferMetric()
        return KVTransferMetric(transfer_latency_s=self._concluded - self._first_send)

    def abort(self) -> None:
        """SGLang aborts the request: nothing more of it is sent, it ends ``Failed`` here, and each decode
        side that published it is told at once (it fails it instead of waiting for its deadline)."""
        if self.mgr.status.get(self.room) not in (KVPoll.Success, KVPoll.Failed):
            self.mgr.abort_room(self.room, "aborted by the prefill's scheduler")

    def clear(self) -> None:
        """SGLang is done with the request: drop its state and its destination lists."""
        self.mgr.forget_room(self.room)
