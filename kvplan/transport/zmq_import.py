"""pyzmq, which every control channel uses, or one line naming the extra that installs it.

kvplan's planner needs only torch, triton and numpy; moving bytes needs a control channel, whatever the
engine, and so pyzmq, which every engine's extra brings (``ipc`` brings it alone).

Example::

    zmq = require_zmq()
    socket = zmq.Context.instance().socket(zmq.DEALER)
"""

from __future__ import annotations

from types import ModuleType

from ..errors import KvplanError

__all__ = ["MissingExtra", "require_zmq"]

INSTALL_ZMQ = ("kvplan's transport needs pyzmq for its control channel: install kvplan with an engine's extra, "
               "e.g. pip install 'kvplan-0.1.0-py3-none-any.whl[ipc]' (or [nixl], [nixl-cu13], [mooncake], "
               "[mooncake-cuda]; README: install)")


class MissingExtra(KvplanError, ImportError):
    """A package an optional part of kvplan needs is not installed; the message names the extra."""


def require_zmq() -> ModuleType:
    """The ``zmq`` module (:class:`MissingExtra` naming kvplan's extras when pyzmq is not installed)."""
    try:
        import zmq
    except ImportError:
        raise MissingExtra(INSTALL_ZMQ) from None
    return zmq
