"""The decode half of kvplan's SGLang manager (:class:`DecodeManager`, a part of
:class:`~kvplan.integrations.sglang.adapter.KVManager`): its decode endpoint, started when the manager is
made; each request's destination lists published to the prefill rank it paired with (:mod:`.pairing`, off
the scheduler's thread), and each request's state read for SGLang's ``KVPoll``.
"""

from __future__ import annotations

import logging
import time

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll

from typing import Any

from ...errors import KvplanError, LayoutError
from ...planner.contract.plan import DestinationLists
from ...planner.device.destinations import PublishedRequest
from ...transport.decode import DecodeEndpoint
from ..off_thread import OffThread
from .decode_link import DecodeRankLink
from .inputs import state_lists_of
from .kv_args import side_from_kv_args
from .pairing import DecodePairing
from .wire import KV_POLL_STATES, TransferRequest

__all__ = ["DecodeManager"]

log = logging.getLogger(__name__)


class DecodeManager(DecodePairing):
    """The decode role of :class:`~kvplan.integrations.sglang.adapter.KVManager` (its state lives on the manager)."""

    def _init_decode(self) -> None:
        """The decode role's state; with kvplan's protocol its decode endpoint, made (its memory registered
        with the engine) and started now, beside SGLang's pools: every prefill rank found later is
        attached to it as a sender."""
        self.side = self.mirrored(side_from_kv_args(self.kv_args, mla=self.is_mla, attn_tp_size=self.attn_tp_size,
                                                    state_params=self.state_params))
        self.decode: DecodeEndpoint | None = None
        self._aux_rows: dict[int, int] = {}  # each published room's aux row (read by _download_aux)
        if self.protocol == "kvplan":
            self.decode = DecodeEndpoint(self.side, self.engine, [], integrity=self.settings.integrity,
                                         staging=self.staging,
                                         senders=self.settings.staging_senders if self.staging is not None else None,
                                         on_complete=self._download_aux if self.aux_mirror is not None else None)
            self.decode.start()  # its progress thread owns the channels and the engine from here
        self.bootstrap_addr: str | None = None
        # SGLang's decode reads it: per bootstrap address, the prefill's parallel layout (try_ensure_parallel_info)
        self.prefill_info_table: dict[str, Any] = {}
        self._layouts: dict[str, OffThread] = {}  # bootstrap address -> its layout's lookup under way
        self._pairings: dict[tuple[str, int], OffThread] = {}  # (bootstrap address, prefill DP rank) -> its pairing
        self._paired: dict[tuple[str, int], int] = {}  # ... -> the peer index of the prefill rank it found
        self._unpaired: dict[tuple[str, int], tuple[float, str]] = {}  # ... -> a failed pairing: until when, why
        self._link_pairing: tuple[str, OffThread] | None = None  # SGLang's protocol: the link being made, and to whom
        self._senders: dict[tuple[str, int], int] = {}  # a prefill rank's (ip, port) -> its peer index here
        # per peer index: how many decode ranks publish each room to that prefill rank (this one among them)
        self._publishers: dict[int, int] = {}
        self._room_peer: dict[int, int] = {}  # each published room's sender (peer index)
        self.link: DecodeRankLink | None = None  # served by SGLang's own prefill (kvplan_protocol "sglang")
        self._asked: dict[int, float] = {}  # with SGLang's protocol: each room's deadline for its status
        self._registered = False  # this side's buffers with the engine (SGLang's protocol; once)

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's decode asks this before it resolves a request's prefill DP rank: whether the prefill's
        parallel layout at ``bootstrap_addr`` is known (:attr:`prefill_info_table`). It never waits: the
        layout is asked of SGLang's bootstrap server on a thread of its own, and False is returned until
        it has come (SGLang asks again a second later). With ``KVPLAN_BOOTSTRAP=direct`` there is no
        bootstrap server: one prefill rank, reached at that address."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        if self.protocol == "kvplan" and self.settings.bootstrap == "direct":
            from sglang.srt.disaggregation.common.conn import PrefillServerInfo

            self.prefill_info_table[bootstrap_addr] = PrefillServerInfo(
                attn_tp_size=self.attn_tp_size, attn_cp_size=1, dp_size=1, pp_size=1, page_size=self.page_size,
                kv_cache_dtype=None, follow_bootstrap_room=True)
            return True
        return self._layout_ready(bootstrap_addr)

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
        self._room_peer[room] = peer
        self._aux_rows[room] = int(aux_index)
        self.decode.publish_lists([published], [prefix_len], self.timeout, peer=peer,
                                  publishers=self._publishers.get(peer, 1))

    def _download_aux(self, rooms: list) -> None:
        """On the decode endpoint's progress thread, before ``rooms`` are reported complete: their aux rows
        out of the device mirror into SGLang's host buffers, where SGLang's decode reads them."""
        rows = [self._aux_rows[r] for r in rooms if r in self._aux_rows]
        self.aux_mirror.download(rows, deadline=time.monotonic() + min(self.timeout, 5.0))

    def decode_state(self, room: int) -> int:
        """A published room's state: what the decode endpoint reported of it (:meth:`take_ended`), else
        ``Transferring``."""
        if self.link is not None:
            return self._sglang_state(room)
        return self.status.get(room, KVPoll.Transferring)

    def take_ended(self) -> None:
        """Settle the rooms the decode endpoint's progress thread found ended since the last look."""
        for room, reason in self.decode.poll().items():
            if reason is None:
                self._settle(room, KVPoll.Success)
            else:
                self._settle(room, KVPoll.Failed, reason)

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
