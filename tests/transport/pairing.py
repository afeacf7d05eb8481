"""Pairing two endpoints of one test process over real control channels: a pairing's first send waits for
the other end's hello (kvplan.transport.auth). A connecting end greets as soon as it is made, but a bound end
only once its owner touches it (a send or a read), so a connecting end that sends first waits on a bound end
that nobody reads: these helpers run the senders on threads while the readers run here, in order, whichever
end binds."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence


def pair(senders: Sequence[Callable[[], Any]], readers: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run every ``senders`` call on a thread of its own and ``readers`` here one after another; what the
    readers returned (a sender's exception is raised here)."""
    with ThreadPoolExecutor(max(1, len(senders))) as pool:
        sent = [pool.submit(call) for call in senders]
        try:
            read = [call() for call in readers]
        finally:
            for future in sent:
                future.result(timeout=30)
    return read


def killed(channel) -> None:
    """End ``channel`` as its process's death would: every descriptor closed at once, nothing queued sent
    (ControlChannel.close would give queued messages a second to leave)."""
    # (the monitor stopped first: a socket that closes emits a disconnection into its monitor, and libzmq's
    # I/O thread, which sends it, waits for ever on a monitor whose reading end is closed, and with it every
    # socket of the process)
    channel.socket.disable_monitor()
    channel.socket.close(linger=0)
    channel._monitor.close(0)
    channel._unwatch()  # (its duplicate of the connection, ControlChannel._watch)
