"""A decode endpoint as a prefill endpoint sees it (:class:`Peer`), and what the prefill's parts share about
their peers: a channel's current pairing, a registration's staging share, the bounds on what a peer's
messages may claim."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..errors import LayoutError
from ..planner.contract.batch import SideMemory
from ..planner.contract.plan import DestinationLists
from .completion import encode_notification
from .control import ControlChannel
from .note_seal import opened, sealed

__all__ = ["ACK_S", "MAX_PUBLISHERS", "Peer", "pairing_of", "staging_share"]

ACK_S = 0.5  # how long an abort's acknowledgement may wait on a full control socket
MAX_PUBLISHERS = 1024  # decode endpoints one request may be spread over (a larger count in a message is ignored)


def pairing_of(channel: Any) -> int | None:
    """A channel's current pairing (:meth:`ControlChannel.pairing_id`; 0 for channels without pairings:
    tests' in-memory ones)."""
    pairing_id = getattr(channel, "pairing_id", None)
    return 0 if pairing_id is None else pairing_id()


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
    # messages held while a batch's writes to this peer are in flight (an abort is acknowledged, a registration
    # taken, only once none is): read in the order they came once none is
    held: deque = field(default_factory=deque)
    prepared: bool = False
    plannable: bool = False  # its staged runs may go without tables (receiver_plan.receiver_can_plan)
    planning: set = field(default_factory=set)  # requests it published with a row: it can plan their scatter
    index_there: int | None = None  # how that endpoint knows this sender, where it has several (notifications name it)
    credits_by_engine: bool = False  # it returns staged slots' credits as engine notifications (Capabilities.notifies)
    notified: bool = True  # it learns of a write from the write's notification (else from another message)
    dropped: bool = False  # it is gone and what it published was dropped (:meth:`PrefillEndpoint._drop`)
    integrity: bool = False  # it asked for each request's checksum (.integrity)
    pairing: int | None = None  # the channel's pairing it registered in (ControlChannel.pairing_id; None: paired elsewhere)
    owned: bool = False  # its channel came through add_peer (a listener's): closed once the peer is gone

    def notification(self, section: Any) -> bytes:
        """A direct or prepared write's notification of ``section``, naming this sender where the
        endpoint has several; empty for a peer that takes none (the engine then notifies nothing)."""
        return self.sealed(encode_notification(section, self.index_there)) if self.notified else b""

    def sealed(self, note: bytes) -> bytes:
        """``note`` as this peer's engine takes it (:func:`.note_seal.sealed`)."""
        return sealed(self.channel, note)

    def opened(self, raw: bytes) -> bytes | None:
        """An engine notification from this peer, opened (:func:`.note_seal.opened`)."""
        return opened(self.channel, raw)

    def recv(self, deadline: float) -> tuple[str, dict[str, Any], list[bytes]]:
        return self.backlog.popleft() if self.backlog else self.channel.recv(deadline)


def staging_share(value: Any) -> tuple[int, int] | None:
    """A registration's staging share ``[address, bytes]`` (``None``: it has no staging buffer)."""
    if not value:
        return None
    if not isinstance(value, list) or len(value) != 2 or not all(isinstance(x, int) and x >= 0 for x in value) \
            or value[0] + value[1] >= 1 << 64:
        raise LayoutError(f"the registration's staging share is {value!r}, not [address, bytes]")
    return value[0], value[1]
