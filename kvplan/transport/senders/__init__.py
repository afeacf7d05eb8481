"""The senders of :meth:`~kvplan.transport.prefill.PrefillEndpoint.send`, one module per mode.

The endpoint plans a batch, picks the mode (``auto`` by the batch's descriptors and bytes) and hands
the planned batch to that mode's sender:

* :mod:`.direct`: every section posted as one engine write with its notification;
* :mod:`.prepared`: the same through NIXL prepared descriptor lists and the planner's indices;
* :mod:`.staged`: waves gathered into a ring of staging slots, one write each (:class:`.staged.StagedRun`);
* :mod:`.streamed`: a batch still being written by the forward pass, each layer group once marked,
  direct or staged.

A sender sees the endpoint only through its :class:`.context.SendContext` (engine, peers, staging
and its stream, and the endpoint's verbs). Every sender ends through the endpoint's one completion
and fencing path: its writes are waited for under the deadline (``verbs.settle``, a
:class:`~..runtime.moving.Moving` the sender returns: the progress thread steps several batches'
writes in one loop), and a request is
failed, and reported to its decode side, only through ``verbs.fail``, which keeps requests whose
writes may still land as unsafe (never acknowledged as fenced). A mode is added by a module here and
an entry in :data:`SENDERS`.
"""

from __future__ import annotations

from typing import Callable

from . import direct, prepared, staged

__all__ = ["SENDERS"]

# mode -> send(context, transfers, planned batch, pending plan, batch, deadline) -> Moving (its result:
# {request: None | reason})
SENDERS: dict[str, Callable] = {"direct": direct.send, "prepared": prepared.send, "staged": staged.send}
