"""SGLang's ``BaseKVReceiver`` over kvplan's decode manager (:class:`KVReceiver`), and the error both
sides' ``failure_exception`` raise (:class:`TransferFailed`).
"""

from __future__ import annotations

import time
from typing import Any, Optional

from sglang.srt.disaggregation.base.conn import BaseKVReceiver, KVPoll

from ...errors import KvplanError
from .decode_manager import DecodeManager
from .inputs import ids, state_lists

__all__ = ["KVReceiver", "TransferFailed"]


class TransferFailed(KvplanError):
    """What ``failure_exception`` raises: the request's transfer failed, with the reason."""


class KVReceiver(BaseKVReceiver):
    """One request's receiver on the decode side (SGLang's ``BaseKVReceiver``), over a decode
    :class:`~kvplan.integrations.sglang.adapter.KVManager`."""

    require_staging = False  # kvplan stages inside its own transport: SGLang's decode staging is not asked for

    def __init__(self, mgr: DecodeManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None):
        self.mgr, self.bootstrap_addr, self.room = mgr, bootstrap_addr, int(bootstrap_room or 0)
        self.kv_mgr = mgr  # (SGLang's scheduler reads the receiver's manager by this name)
        self.published = False
        self.prefill_dp_rank: int | None = None  # set by init
        self.peer: int | None = None  # the prefill rank's peer index, once paired
        self._lists: tuple | None = None  # destination lists handed before the pairing ended: published once it has
        self._started = time.monotonic()
        self.abort_notified = False  # whether the prefill was told of this request's abort
        self.bootstrap_infos: list[dict[str, Any]] | None = None  # the prefill rank(s) this request reads from

    @property
    def conclude_state(self) -> Optional[int]:
        """``Success`` or ``Failed`` once the request concluded here, else None (SGLang reads it after
        ``init``)."""
        state = self.mgr.status.get(self.room)
        return state if state in (KVPoll.Success, KVPoll.Failed) else None

    @property
    def supports_host_destination(self) -> bool:
        return False  # kvplan writes into the decode's device pool only

    def init(self, prefill_dp_rank: int = 0) -> None:
        """Start finding and pairing with the prefill rank that serves this request (on a thread of the
        manager's: :mod:`.pairing`); it returns at once. A pairing that cannot be made ends the request
        ``Failed`` with the reason instead of raising into SGLang's scheduler."""
        self.prefill_dp_rank = int(prefill_dp_rank)
        self.bootstrap_infos = [{"bootstrap_addr": self.bootstrap_addr, "prefill_dp_rank": self.prefill_dp_rank}]
        self._pairing()

    def _pairing(self) -> bool:
        """Whether this request's prefill rank is paired (its peer index is :attr:`peer`); a failed
        pairing, or one past the manager's timeout, fails the request."""
        if self.peer is not None:
            return True
        try:
            self.peer = self.mgr.pair(self.bootstrap_addr, self.prefill_dp_rank)
        except KvplanError as err:
            self.mgr._settle(self.room, KVPoll.Failed, str(err))
            return False
        if self.peer is None and time.monotonic() - self._started > self.mgr.timeout:
            self.mgr._settle(self.room, KVPoll.Failed, f"no prefill rank paired at {self.bootstrap_addr} within "
                                                       f"{self.mgr.timeout} s")
        return self.peer is not None

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None, state_indices: Optional[list] = None,
                      decode_prefix_len: Optional[int] = None, destination: Any = None) -> None:
        """Publish this request's destination lists to its prefill rank; before the pairing has ended they
        are kept and published once it has (at a later :meth:`poll`)."""
        if self.conclude_state is not None:  # failed at init (or aborted): nothing to publish
            return
        self._lists = (ids(kv_indices), int(aux_index or 0), int(decode_prefix_len or 0), state_lists(state_indices))
        if self.peer is not None:
            self._publish()

    def _publish(self) -> None:
        pages, aux_index, prefix_len, state = self._lists
        self._lists = None
        self.mgr.publish(self.room, pages, aux_index, prefix_len, state, peer=self.peer)
        self.published = True

    def poll(self) -> int:
        """``Bootstrapping`` while the pairing is under way, ``WaitingForInput`` once paired, then
        ``Transferring`` once published, and ``Success`` or ``Failed``. It never waits."""
        mgr = self.mgr
        if self.room in mgr.status:
            return mgr.status[self.room]
        mgr.advance()
        if self.prefill_dp_rank is None or not self._pairing():
            return mgr.status.get(self.room, KVPoll.Bootstrapping)
        if self._lists is not None:
            self._publish()
        if not self.published:
            return KVPoll.WaitingForInput
        return mgr.decode_state(self.room)

    def failure_exception(self):
        raise TransferFailed(self.mgr.failures.get(self.room, f"request {self.room} failed"))

    def abort(self) -> None:
        """SGLang aborts the request: it ends ``Failed`` here and the prefill is told (once), which then
        sends nothing more of it. Writes already posted are not fenced yet."""
        if self.conclude_state is None:
            self.mgr._settle(self.room, KVPoll.Failed, "aborted by the decode's scheduler")
        self.ensure_abort_notified()

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Tell the prefill of the abort, once (SGLang calls it for a failure the decode did not start)."""
        if not self.abort_notified and self.published:
            self.mgr.abort_room(self.room, self.mgr.failures.get(self.room, "aborted by the decode's scheduler"))
            self.abort_notified = True

    def is_abort_release_safe(self) -> bool:
        """Whether no write into the aborted request's pages can still land. kvplan cannot prove that yet
        (docs/failures.md §2), so SGLang is never told it can: only asked for host destinations, which kvplan does
        not take."""
        return False

    def clear(self) -> None:
        """SGLang is done with the request: drop what the manager keeps of it."""
        self.mgr.forget_room(self.room)
