"""What a sender may use of the prefill endpoint that sends: :class:`SendContext`.

The endpoint makes one when it is made and hands it to every sender (``direct``, ``prepared``,
``staged``, ``streamed``); a sender sees the engine, the peers, the staging buffer and its stream,
and the endpoint's few verbs (settle what was posted, fail requests, the sides' copy alignment, a
peer's share of the staging ring, whether a peer is gone), never the endpoint itself. What a send
leaves for the caller to read (the mode it used, how its staged run was announced, waves gathered
ahead) is kept here and read through the endpoint's attributes of the same names.

Example::

    ctx = SendContext(endpoint_id, engine, side, peers, policy, staging=None, stream=None, ahead=None,
                      receiver_plans=True, verbs=SendVerbs(settle, fail, alignment, ring, peer_gone,
                                                           any_peer_gone, stats_hit))
    direct.send(ctx, transfers, planned, pending, batch, deadline)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ...planner.contract.batch import Batch, Policy, SideMemory, Transfer
from ..ahead import AheadGatherer
from ..engines.base import Engine, Handle
from ..prefill_peers import Peer

__all__ = ["SendContext", "SendVerbs"]


@dataclass(frozen=True)
class SendVerbs:
    """The endpoint's own steps a sender calls (each documented where the endpoint defines it)."""

    # posted (handle, section) pairs ending under the deadline, a Moving whose result is each transfer's
    # request -> None or why
    settle: Callable[[Sequence[Transfer], list[tuple[Handle, Any]], float], Any]
    # fail requests of one peer in a result, keeping those whose writes may still land unfenced
    fail: Callable[[int, dict[Any, str | None], Sequence[Any], str], None]
    alignment: Callable[[Batch], int]  # the copy word the batch's sides allow
    # (slots, bytes per slot) of the ring to a peer (its alignment) over some bytes of this side's staging buffer
    ring: Callable[[int, int, int | None], tuple[int, int]]
    peer_gone: Callable[[int], str | None]  # why a peer is gone, or None
    any_peer_gone: Callable[[Sequence[int]], str | None]
    stats_hit: Callable[[str], None]  # count a bound that made a send wait


@dataclass
class SendContext:
    """The sending side of one prefill endpoint, as its senders see it (see the module docstring)."""

    id: str  # names this sender's waves on receivers with several senders
    engine: Engine
    side: SideMemory
    peers: list[Peer]  # the endpoint's own list: peers that pair later appear here
    policy: Policy
    staging: torch.Tensor | None
    stream: torch.cuda.Stream | None  # the transport's stream for gathers (on a GPU, with staging)
    ahead: AheadGatherer | None  # a staged run's first wave gathered behind its plan
    receiver_plans: bool
    verbs: SendVerbs
    times: list[tuple[str, float]] = field(default_factory=list)  # the current send's steps, for a trace
    next_wave: int = 0  # the id of the next staged wave
    last_mode: str | None = None  # the mode the last send used (what ``auto`` chose)
    last_announcement: str | None = None  # how its last staged run was announced: "planned" or "table"
    waves_ahead: int = 0  # staged waves gathered ahead of their layer group's mark, over the endpoint's life
    first_waves_ahead: int = 0  # staged runs whose first wave was gathered behind the plan
    # staged runs announced and not ended, every batch's: a run starts once its peer and its part of the
    # staging buffer are free of them (senders.staged.StagedBatch)
    runs: list = field(default_factory=list)

    def wave_ids(self, count: int) -> int:
        """Take ``count`` wave ids; return the first."""
        first = self.next_wave
        self.next_wave += count
        return first
