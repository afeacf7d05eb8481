"""A decode manager's pairing with its prefill ranks, off SGLang's scheduler thread (:class:`DecodePairing`,
a part of :class:`~kvplan.integrations.sglang.adapter.KVManager`).

What waits on a peer runs on a thread of its own (:class:`~kvplan.integrations.off_thread.OffThread`):
the prefill's parallel layout and its rank's address asked of SGLang's bootstrap server, the control
channel opened and authenticated, and with SGLang's protocol the registration with SGLang's prefill.
The scheduler's thread starts a lookup or a pairing and reads how it ended on a later call; it then
attaches the channel to the (started) decode endpoint, which sends this side's registration from its
own progress thread. A request whose pairing is under way polls ``Bootstrapping``; one whose pairing
failed polls ``Failed`` with the reason, and so does every request for that prefill rank in the next
:data:`RETRY_S` (one failed handshake, not one wait per request).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ...errors import KvplanError, LayoutError, PeerError
from ...transport.control import ControlChannel
from ...transport.decode import engine_regions
from ...transport.listener import channel_via
from ..off_thread import OffThread
from .bootstrap import BootstrapNotReady, prefill_layout, prefill_rank
from .decode_link import DecodeRankLink
from .engine_identity import identity
from .inputs import host_port, nested
from .wire import Registration

__all__ = ["DecodePairing", "LOOKUP_S", "RETRY_S"]

log = logging.getLogger(__name__)

LOOKUP_S = 5.0  # the longest one bootstrap lookup or one channel's handshake may take (each, on the pairing's thread)
RETRY_S = 1.0  # after a pairing failed, its prefill rank's requests fail at once for this long, then one is tried again
# a bootstrap server whose prefill ranks are not all registered is asked again every NOT_READY_PAUSE_S for up to
# NOT_READY_S, so that SGLang's next look (a second after its first) finds the layout once they are
NOT_READY_S, NOT_READY_PAUSE_S = 0.9, 0.05


@dataclass
class FoundRank:
    """What a pairing's thread found: the prefill rank's control address, an open channel to it, how
    many decode ranks publish each request to it, and the prefill's layout if it fetched it itself."""

    rank_addr: tuple[str, int]
    channel: ControlChannel
    publishers: int
    layout: Any = None


class DecodePairing:
    """The pairing of :class:`~kvplan.integrations.sglang.adapter.KVManager`'s decode role (its state lives
    on the manager: ``_layouts``, ``_pairings``, ``_paired``, ``_unpaired``)."""

    def _bootstrap_layout(self, bootstrap_addr: str) -> Any:
        """SGLang's ``PrefillServerInfo`` of the prefill at ``bootstrap_addr`` (on a lookup's thread)."""
        from sglang.srt.disaggregation.common.conn import PrefillServerInfo

        host, port = host_port(bootstrap_addr)
        until = time.monotonic() + NOT_READY_S
        while True:
            try:
                layout = prefill_layout(host, port, timeout=min(LOOKUP_S, self.timeout))
                break
            except BootstrapNotReady:  # (not every prefill rank has registered yet: asked again shortly)
                if time.monotonic() > until:
                    raise
                time.sleep(NOT_READY_PAUSE_S)
        return PrefillServerInfo(
            attn_tp_size=layout.attn_tp_size, attn_cp_size=layout.attn_cp_size, dp_size=layout.dp_size,
            pp_size=layout.pp_size, page_size=layout.page_size, kv_cache_dtype=layout.kv_cache_dtype,
            follow_bootstrap_room=layout.follow_bootstrap_room,
            enable_dsa_cache_layer_split=layout.enable_dsa_cache_layer_split, kv_layout=layout.kv_layout,
            decode_allocation_policy=layout.decode_allocation_policy,
            enable_kv_cache_sharding=layout.enable_kv_cache_sharding, prefill_http_port=layout.prefill_http_port)

    def _layout_ready(self, bootstrap_addr: str) -> bool:
        """Whether the prefill's layout at ``bootstrap_addr`` is known; else start (or read) its lookup."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        lookup = self._layouts.get(bootstrap_addr)
        if lookup is not None and lookup.done():
            del self._layouts[bootstrap_addr]
            if lookup.error is None:
                self.prefill_info_table[bootstrap_addr] = lookup.value
                return True
            level = logging.DEBUG if isinstance(lookup.error, BootstrapNotReady) else logging.WARNING
            log.log(level, "the prefill's layout at %s is not known yet: %s", bootstrap_addr, lookup.reason())
            lookup = None
        if lookup is None:  # (asked again at once: SGLang's next look, a second later, reads its answer)
            self._layouts[bootstrap_addr] = OffThread(lambda: self._bootstrap_layout(bootstrap_addr),
                                                      "kvplan-sglang-bootstrap")
        return False

    def pair(self, bootstrap_addr: str, prefill_dp_rank: int = 0) -> int | None:
        """The peer index of the prefill rank that serves this decode rank for requests of
        ``bootstrap_addr`` (and ``prefill_dp_rank``); None while its pairing is under way (started now if
        none is). Never waits. Raises :class:`~kvplan.errors.PeerError` or
        :class:`~kvplan.errors.LayoutError`, with the reason, when the pairing failed within the last
        :data:`RETRY_S` or cannot be made."""
        if self.protocol == "sglang":
            return self._pair_sglang(bootstrap_addr)
        key = (bootstrap_addr, int(prefill_dp_rank))
        if key not in self._paired:
            self._take_pairing(key)
        if key in self._paired:
            return self._paired[key]
        until, reason = self._unpaired.get(key, (0.0, ""))
        if time.monotonic() < until:
            raise PeerError(reason)
        if key not in self._pairings:
            layout = self.prefill_info_table.get(bootstrap_addr)
            self._pairings[key] = OffThread(lambda: self._find_rank(bootstrap_addr, int(prefill_dp_rank), layout),
                                            "kvplan-sglang-pairing")
        return None

    def _find_rank(self, bootstrap_addr: str, prefill_dp_rank: int, layout: Any) -> FoundRank:
        """On a pairing's thread: the prefill rank's address (through SGLang's bootstrap server, or the
        address itself with ``KVPLAN_BOOTSTRAP=direct``) and a control channel to it, authenticated."""
        host, port = host_port(bootstrap_addr)
        wait = min(LOOKUP_S, self.timeout)
        fetched, publishers = None, 1
        if self.settings.bootstrap == "direct":  # kvplan's listener is the bootstrap port itself
            rank_addr = (host, port)
        else:
            if layout is None:
                layout = fetched = self._bootstrap_layout(bootstrap_addr)
            prefill_tp, mine = int(layout.attn_tp_size), self.attn_tp_size
            rank_addr = prefill_rank(host, port, tp_rank=self._target_tp_rank(prefill_tp), dp_rank=prefill_dp_rank,
                                     timeout=wait)
            # a larger decode TP: each prefill rank serves mine / its ranks, and waits for all of them
            publishers = mine // prefill_tp if mine > prefill_tp and mine % prefill_tp == 0 else 1
        channel = channel_via(*rank_addr, timeout=wait, **self.settings.channel_security())
        return FoundRank(tuple(rank_addr), channel, publishers, fetched)

    def _take_pairing(self, key: tuple[str, int]) -> None:
        """If ``key``'s pairing has ended: attach its channel to the decode endpoint (a sender), or keep why
        it failed for :data:`RETRY_S`."""
        pairing = self._pairings.get(key)
        if pairing is None or not pairing.done():
            return
        del self._pairings[key]
        bootstrap_addr = key[0]
        if pairing.error is not None:
            self._pairing_failed(key, pairing.error)
            return
        found: FoundRank = pairing.value
        if found.layout is not None:
            self.prefill_info_table.setdefault(bootstrap_addr, found.layout)
        peer = self._senders.get(found.rank_addr)
        if peer is not None:  # (another key led to the same rank: one sender, one channel)
            found.channel.close()
        else:
            try:
                peer = self.decode.add_sender(found.channel, self.timeout)
            except KvplanError as err:
                found.channel.close()
                self._pairing_failed(key, err, f"the prefill rank at {found.rank_addr} cannot be taken")
                return
            self._senders[found.rank_addr] = peer
            self._publishers[peer] = found.publishers
            log.info("paired with the prefill rank at %s:%d (sender %d)", *found.rank_addr, peer)
        self._paired[key] = peer
        self.bootstrap_addr = self.bootstrap_addr or bootstrap_addr

    def _pairing_failed(self, key: tuple[str, int], err: BaseException, what: str | None = None) -> None:
        """Keep why ``key``'s pairing failed: its requests fail with it for :data:`RETRY_S`."""
        what = what or f"no prefill rank to pair with at {key[0]}"
        self._unpaired[key] = (time.monotonic() + RETRY_S, f"{what}: {type(err).__name__}: {err}")

    def _pair_sglang(self, bootstrap_addr: str) -> int | None:
        """With SGLang's protocol: one link to SGLang's prefill, registered on a pairing's thread; 0 once
        it is, None while it is being made."""
        if self.link is None and self._link_pairing is not None and self._link_pairing[1].done():
            addr, pairing = self._link_pairing
            self._link_pairing = None
            if pairing.error is not None:
                self._pairing_failed((addr, 0), pairing.error)
            else:
                self.link, self.bootstrap_addr = pairing.value, addr
        paired_with = self.bootstrap_addr if self.link is not None else \
            self._link_pairing[0] if self._link_pairing is not None else None
        if paired_with is not None and paired_with != bootstrap_addr:
            raise LayoutError(f"with SGLang's protocol this decode manager is paired with {paired_with}; "
                              f"one prefill per decode manager, not also {bootstrap_addr}")
        if self.link is not None:
            return 0
        until, reason = self._unpaired.get((bootstrap_addr, 0), (0.0, ""))
        if time.monotonic() < until:
            raise PeerError(reason)
        if self._link_pairing is None:
            host, port = host_port(bootstrap_addr)
            self._link_pairing = (bootstrap_addr, OffThread(lambda: self._link_sglang(host, port),
                                                            "kvplan-sglang-pairing"))
        return None

    def _link_sglang(self, host: str, port: int) -> DecodeRankLink:
        """On a pairing's thread: register this side's buffers with the engine and its layout with SGLang's
        prefill rank; the link."""
        backend, args = self.engine_kind, self.kv_args
        if not self._registered:  # first (once): NIXL's metadata carries the registrations
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
        return link

    def _close_pairings(self) -> list:
        """Wait (each up to its handshake's bound) for the pairings under way; the closers of what they opened."""
        closers = []
        pairings = list(self._pairings.values()) + ([self._link_pairing[1]] if self._link_pairing else [])
        for pairing in pairings:  # (a link's registration waits up to the manager's timeout)
            if pairing.join(max(LOOKUP_S, self.timeout) + 1.0) and pairing.value is not None:
                opened = pairing.value
                closers.append(opened.channel.close if isinstance(opened, FoundRank) else opened.close)
        self._pairings, self._link_pairing = {}, None
        return closers
