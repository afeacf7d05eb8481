"""What the control channel's messages are on the wire, shared by its parts (:mod:`.control`,
:mod:`.control_handshake`, :mod:`.control_liveness`): the protocol's mark, a message's parsing, the
request a message names, the socket monitor's event names."""

from __future__ import annotations

import ipaddress
import itertools
import json
from typing import Any

from ..errors import KvplanError

__all__ = ["EVENT_NAMES", "MARK", "MAX_REFUSED", "TCP_ESTABLISHED", "ControlTimeout", "is_loopback", "named_request",
           "parse_parts"]

MAX_REFUSED = 4096  # requests one "refuse" message names at most (a sender keeps the last 4096 refused)
MARK = b"kvp1"  # the first frame of every message of this protocol
EVENT_NAMES = {1: "connected", 2: "connect delayed", 4: "connect retried", 32: "accepted", 512: "disconnected",
               0x0800: "handshake failed", 0x1000: "handshake succeeded", 0x2000: "handshake failed (protocol)",
               0x4000: "handshake failed (auth)"}
TCP_ESTABLISHED = 1  # Linux's tcpi_state of a connection that stands (include/net/tcp_states.h)
monitor_numbers = itertools.count()  # (one inproc address per monitored socket of the process)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ControlTimeout(KvplanError, TimeoutError):
    """No control message arrived before the deadline."""


class SecretMismatch(ControlTimeout):
    """The two ends of a channel cannot pair: their shared secrets differ, or one side has none. Raised on a
    connecting end as soon as the peer's hello or proof shows it, on a bound end when its wait for a peer
    ends; the message says which of ``secret mismatch``, ``peer requires a secret`` and ``peer has no
    secret`` it is. A subclass of :class:`ControlTimeout`: what fails on a channel that cannot pair fails
    alike."""


def parse_parts(parts: list[bytes]) -> tuple[str, dict[str, Any], list[bytes]]:
    """A message's kind, header and frames; what a peer sends malformed becomes kind ``"malformed"``
    (every handler ignores kinds it does not know), never an exception in the receiving loop."""
    try:
        header = json.loads(parts[1])
        if isinstance(header, dict):
            return parts[0].decode(), header, parts[2:]
    except (IndexError, UnicodeDecodeError, ValueError):
        pass
    return "malformed", {}, parts


def named_request(header: dict[str, Any]) -> str | int | None:
    """The request a peer's message names, if it names one as a request is named (a string or an
    integer); ``None`` for anything else, which no lookup may be handed (a list is not hashable)."""
    request = header.get("request")
    return request if isinstance(request, (str, int)) and not isinstance(request, bool) else None
