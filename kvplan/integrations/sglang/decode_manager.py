"""The decode half of kvplan's SGLang manager (:class:`DecodeManager`, a part of
:class:`~kvplan.integrations.sglang.adapter.KVManager`): the prefill found through SGLang's bootstrap server
and paired, each request's destination lists published to it, and each request's state read for
SGLang's ``KVPoll``.
"""

from __future__ import annotations

import logging
import time

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll

from ...errors import KvplanError, LayoutError, PeerError
from ...planner.device.destinations import PublishedRequest
from ...planner.contract.plan import DestinationLists
from ...transport.listener import channel_via
from ...transport.decode import DecodeEndpoint, engine_regions
from .decode_link import DecodeRankLink
from .bootstrap import BootstrapNotReady, prefill_layout, prefill_rank
from .engine_identity import identity
from .wire import KV_POLL_STATES, Registration, TransferRequest
from .inputs import host_port, nested, state_lists_of
from ...transport.control_messages import Kind

__all__ = ["DecodeManager"]

log = logging.getLogger(__name__)


class DecodeManager:
    """The decode role of :class:`~kvplan.integrations.sglang.adapter.KVManager` (its state lives on the manager)."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's decode asks this before it resolves a request's prefill DP rank: the prefill's
        parallel layout at ``bootstrap_addr``, fetched once from SGLang's bootstrap server (one try, never
        blocking past its timeout) into :attr:`prefill_info_table`; False while the server or some
        prefill rank is not up yet (SGLang tries again). With ``KVPLAN_BOOTSTRAP=direct`` there is no
        bootstrap server: one prefill rank, reached at that address."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        from sglang.srt.disaggregation.common.conn import PrefillServerInfo

        if self.protocol == "kvplan" and self.settings.bootstrap == "direct":
            self.prefill_info_table[bootstrap_addr] = PrefillServerInfo(
                attn_tp_size=self.attn_tp_size, attn_cp_size=1, dp_size=1, pp_size=1, page_size=self.page_size,
                kv_cache_dtype=None, follow_bootstrap_room=True)
            return True
        host, port = host_port(bootstrap_addr)
        try:
            layout = prefill_layout(host, port, timeout=min(5.0, self.timeout))
        except KvplanError as err:
            level = logging.DEBUG if isinstance(err, BootstrapNotReady) else logging.WARNING
            log.log(level, "the prefill's layout at %s is not known yet: %s", bootstrap_addr, err)
            return False
        self.prefill_info_table[bootstrap_addr] = PrefillServerInfo(
            attn_tp_size=layout.attn_tp_size, attn_cp_size=layout.attn_cp_size, dp_size=layout.dp_size,
            pp_size=layout.pp_size, page_size=layout.page_size, kv_cache_dtype=layout.kv_cache_dtype,
            follow_bootstrap_room=layout.follow_bootstrap_room,
            enable_dsa_cache_layer_split=layout.enable_dsa_cache_layer_split, kv_layout=layout.kv_layout,
            decode_allocation_policy=layout.decode_allocation_policy,
            enable_kv_cache_sharding=layout.enable_kv_cache_sharding, prefill_http_port=layout.prefill_http_port)
        return True

    def _target_tp_rank(self, prefill_tp: int) -> int:
        """The prefill attention-TP rank that holds this decode rank's part (one rank: docs/sglang.md)."""
        mine, rank = self.attn_tp_size, self.attn_tp_rank
        if mine >= prefill_tp and mine % prefill_tp == 0:
            return rank // (mine // prefill_tp)
        if self.is_mla and prefill_tp % mine == 0:  # MLA's KV is whole on every prefill rank: one of them
            return rank * (prefill_tp // mine)
        raise LayoutError(f"decode attention TP {mine} rank {rank} takes its heads from several prefill ranks of TP "
                          f"{prefill_tp}; the adapter pairs a decode rank with one prefill rank (decode TP a "
                          "multiple of prefill TP, or MLA)")

    def connect(self, bootstrap_addr: str, prefill_dp_rank: int = 0) -> int:
        """Find the prefill rank that serves this decode rank and pair with it (once per rank): through
        SGLang's bootstrap server (its parallel layout, then the rank's control socket), or at the address
        itself with ``KVPLAN_BOOTSTRAP=direct``; with SGLang's protocol, register with SGLang's prefill.
        Returns the prefill rank's peer index."""
        host, port = host_port(bootstrap_addr)
        if self.protocol == "sglang":
            if self.link is None:
                self._connect_sglang(host, port)
                self.bootstrap_addr = bootstrap_addr
            elif bootstrap_addr != self.bootstrap_addr:
                raise LayoutError(f"with SGLang's protocol this decode manager is paired with {self.bootstrap_addr}; "
                                  f"one prefill per decode manager, not also {bootstrap_addr}")
            return 0
        if self.settings.bootstrap == "direct":  # kvplan's listener is the bootstrap port itself
            rank_addr = (host, port)
        else:
            if not self.try_ensure_parallel_info(bootstrap_addr):
                raise PeerError(f"the prefill's layout at {bootstrap_addr} is not known (SGLang's bootstrap server)")
            info = self.prefill_info_table[bootstrap_addr]
            rank_addr = prefill_rank(host, port, tp_rank=self._target_tp_rank(int(info.attn_tp_size)),
                                     dp_rank=int(prefill_dp_rank), timeout=min(5.0, self.timeout))
        if rank_addr in self._senders:
            return self._senders[rank_addr]
        publishers = 1
        if self.settings.bootstrap != "direct":  # a larger decode TP: each prefill rank serves mine / its ranks
            prefill_tp, mine = int(self.prefill_info_table[bootstrap_addr].attn_tp_size), self.attn_tp_size
            publishers = mine // prefill_tp if mine > prefill_tp and mine % prefill_tp == 0 else 1
        channel = channel_via(*rank_addr, timeout=self.timeout, secret=self.settings.secret())
        if self.decode is None:
            self.decode = DecodeEndpoint(self.side, self.engine, channel, integrity=self.settings.integrity,
                                         staging=self.staging,
                                         senders=self.settings.staging_senders if self.staging is not None else None)
            self.decode.register(timeout=self.timeout)
            peer = 0
        else:
            peer = self.decode.add_sender(channel, self.timeout)
        self._senders[rank_addr] = peer
        self._publishers[peer] = publishers
        self.bootstrap_addr = self.bootstrap_addr or bootstrap_addr
        return peer

    def _connect_sglang(self, host: str, port: int) -> None:
        """Register this side's buffers with the engine and its layout with SGLang's prefill rank."""
        backend, args = self.engine_kind, self.kv_args
        if not self._registered:  # first: NIXL's metadata carries the registrations
            self.engine.register(engine_regions(self.side))
            self._registered = True
        named = identity(self.engine, backend, len(args.kv_data_ptrs))
        link = DecodeRankLink(named.pop("session_id"), rank_ip=self.host, backend=backend)
        try:
            slots = min((int(n) // int(i) for n, i in zip(args.kv_data_lens, args.kv_item_lens)), default=0)
            reg = Registration(endpoint="", port=0, session_id="", kv_ptrs=tuple(args.kv_data_ptrs),
                               kv_item_lens=tuple(args.kv_item_lens), aux_ptrs=tuple(args.aux_data_ptrs),
                               tp_rank=int(args.engine_rank), attn_tp_size=self.attn_tp_size,
                               state_ptrs=nested(getattr(args, "state_data_ptrs", None)),
                               state_item_lens=nested(getattr(args, "state_item_lens", None)),
                               state_dim_per_tensor=nested(getattr(args, "state_dim_per_tensor", None)),
                               kv_layer_ids=tuple(getattr(args, "kv_layer_ids", None) or ()),
                               state_layer_ids=nested(getattr(args, "state_layer_ids", None)), num_slots=slots,
                               state_data_lens=nested(getattr(args, "state_data_lens", None)), **named)
            link.connect(host, port, reg, page_size=self.page_size, timeout=self.timeout,
                         kv_cache_dtype=str(getattr(args, "kv_cache_dtype_str", None) or "auto"))
        except BaseException:
            link.close()
            raise
        self.link = link

    def publish(self, room: int, pages: np.ndarray, aux_index: int, prefix_len: int,
                state: tuple[np.ndarray, ...] | None = None, peer: int = 0) -> None:
        lists = state_lists_of(room, state, self.side.state) if self.side.state else ()
        if self.link is not None:  # SGLang's prefill writes them itself; its status settles the room
            self.link.ask(TransferRequest(room, "", 0, "", pages.astype(np.int32), int(aux_index),
                                          tuple(tuple(int(i) for i in ids) for ids in lists),
                                          decode_prefix_len=prefix_len), timeout=self.timeout)
            self._asked[room] = time.monotonic() + self.timeout
            return
        published = PublishedRequest(room, DestinationLists(pages.astype(np.int64), lists), int(aux_index),
                                     tuple(c.name for c in self.side.state), bool(self.side.aux))
        self.decode.track([published], time.monotonic() + self.timeout, peer=peer)
        self._room_peer[room] = peer
        self.decode.channels[peer].send(Kind.REQUEST, {"request": room, "prompt_len": prefix_len + len(pages) *
                                                    self.page_size, "prefix_len": prefix_len,
                                                    "publishers": self._publishers.get(peer, 1)}, published.message(),
                                        timeout=self.timeout)

    def decode_state(self, room: int) -> int:
        if self.link is not None:
            return self._sglang_state(room)
        tracker = self.decode.tracker
        state = tracker.state(room) if room in tracker else None
        if state == "complete":
            self._settle(room, KVPoll.Success)
        elif state == "failed":
            self._settle(room, KVPoll.Failed, tracker.failure(room) or "failed")
        if state in ("complete", "failed"):
            tracker.forget(room)
            self.decode.guard.forget(room)
        return self.status.get(room, KVPoll.Transferring)

    def _sglang_state(self, room: int) -> int:
        """A room's state from SGLang's prefill's status messages, failed once its deadline passes."""
        for msg in self.link.poll():
            if msg.status == KVPoll.Success:
                self._settle(msg.room, KVPoll.Success)
            elif msg.status == KVPoll.Failed:
                self._settle(msg.room, KVPoll.Failed, msg.reason or "the prefill reported it failed")
            else:
                log.debug("request %s: the prefill reports %s", msg.room, KV_POLL_STATES[msg.status])
            if msg.status in (KVPoll.Success, KVPoll.Failed):
                self._asked.pop(msg.room, None)
        if room in self._asked and time.monotonic() > self._asked[room]:
            self._asked.pop(room)
            reason = f"no status from the prefill within {self.timeout} s"
            try:  # its pages may be reused once the prefill acknowledges (self.link.acked)
                self.link.abort(room)
            except KvplanError as err:
                reason += f"; the abort could not be sent: {err}"
            self._settle(room, KVPoll.Failed, reason)
        return self.status.get(room, KVPoll.Transferring)
