"""Exceptions raised by kvplan.

Every problem that would make a plan send wrong bytes is an exception of one of these types,
raised before anything is handed to an engine. Plan errors name the request (and where it applies
the chunk and the component) so that a scheduler can fail exactly that request.
"""

from __future__ import annotations


class KvplanError(Exception):
    """Base class of every error kvplan raises on purpose."""


class LayoutError(KvplanError, ValueError):
    """The two sides' memory layouts cannot be paired (page size, entry counts, item lengths...)."""


class PlanError(KvplanError, ValueError):
    """A transfer of the batch is invalid; nothing of the batch may be sent.

    Attributes:
        request: the id of the offending request (``None`` when the error is batch-wide).
    """

    def __init__(self, request: object | None, reason: str):
        self.request = request
        self.reason = reason
        where = f"request {request!r}: " if request is not None else ""
        super().__init__(where + reason)


class AlignmentError(PlanError):
    """A chunk does not start on a page boundary (planning.md §2)."""


class PoolBoundsError(PlanError):
    """A page, slot or row index lies outside its pool (or is the padding page 0)."""


class AllocatorInvariantError(PlanError):
    """The slots of a sent page are not consecutive and page-aligned (planning.md §2)."""


class LengthMismatchError(PlanError):
    """Paired source and destination lists differ in length under the ``strict`` policy."""


class UnmappedSlotError(PlanError):
    """A token inside the sliding window has no SWA slot (translated slot 0)."""


class DestinationOverlapError(PlanError):
    """Two transfers of one batch (or one transfer twice) write the same destination page, slot or row.

    Attributes:
        request: the later of the two claimants, in batch order.
        other: the request that claimed the destination item first (equal to ``request`` when one
            request lists the item twice).
    """

    def __init__(self, request: object | None, other: object | None, reason: str):
        self.other = other
        super().__init__(request, reason)


class InputError(PlanError):
    """An input has the wrong dtype, device, shape or value range."""


class PeerError(KvplanError):
    """What a peer sent does not match what this side published or agreed to; nothing of it was written."""


class SettingError(KvplanError, ValueError):
    """A setting (a ``KVPLAN_*`` variable, an engine setting, an integration's key) that kvplan cannot take.

    Attributes:
        setting: the variable's or the setting's name.
    """

    def __init__(self, setting: str, message: str):
        self.setting = setting
        super().__init__(message)
