"""Every message a prefill and a decode endpoint send each other on their control channel, in one
registry: its kind (:class:`Kind`), who sends it, the header fields it carries, the frames after the
header, and what the receiver does with it (:data:`MESSAGES`). docs/transport.md's table is its
rendering (:func:`markdown_table`; a test fails when they differ), and a channel refuses to send a kind
that is not here.

Senders and readers name a kind by its member (``Kind.ABORT``); a member is its wire string, so a kind
read off the socket compares equal to it. The handshake's own steps (``_hello``, ``_proof``) are the
channel's (:mod:`.control_handshake`), never an endpoint's.

Example::

    channel.send(Kind.FAILED, {"request": request, "reason": reason})
    kind, header, frames = channel.recv(deadline)
    if kind == Kind.FAILED: ...
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Kind", "MESSAGES", "Message", "markdown_table"]


class Kind(enum.StrEnum):
    """A control message's kind, as it travels (see :data:`MESSAGES`)."""

    REGISTER = "register"
    PAIRED = "paired"
    REFUSED = "refused"
    REQUEST = "request"
    ABORT = "abort"
    ABORT_ACK = "abort-ack"
    REFUSE = "refuse"
    FAILED = "failed"
    CHECKSUM = "checksum"
    STAGED = "staged"
    STAGED_PLAN = "staged-plan"
    STAGED_WAVES = "staged-waves"
    WAVE_DONE = "wave-done"


@dataclass(frozen=True)
class Message:
    """One kind's record: who sends it, its header fields (name, meaning), its frames, what it does."""

    kind: Kind
    sender: str  # "decode" or "prefill"
    fields: tuple[tuple[str, str], ...]
    frames: str
    effect: str


MESSAGES: dict[Kind, Message] = {m.kind: m for m in (
    Message(Kind.REGISTER, "decode",
            (("side", "its layout (registration.describe_side)"), ("staging", "[address, bytes] of its share, or null"),
             ("notifies", "whether its engine sends standalone notifications"), ("integrity", "checksums asked"),
             ("compat", "a word both sides must share (optional)"), ("peer", "its index for this sender (optional)")),
            "its engine's metadata",
            "the prefill pairs with the layout or answers `refused`"),
    Message(Kind.PAIRED, "prefill",
            (("from", "the sender's id"), ("side", "its layout"), ("engine", "its engine's name"),
             ("writes_ended", "no write of an earlier incarnation can still land"),
             ("credits", "\"engine\" where wave credits go through the engine (optional)")),
            "its engine's metadata, where credits go through the engine",
            "the decode connects its engine to the sender's"),
    Message(Kind.REFUSED, "prefill", (("reason", "why the layouts do not pair"),), "none",
            "the decode's registration fails with the reason"),
    Message(Kind.REQUEST, "decode",
            (("request", "the request id"), ("prompt_len", "tokens"), ("prefix_len", "tokens already on the decode"),
             ("plans", "the decode plans its own scatter of staged runs (optional)"),
             ("publishers", "decode endpoints publishing this request here (optional)")),
            "the destination lists (SGLang's wire format)",
            "checked against the decode's layout and kept until the request is sent"),
    Message(Kind.ABORT, "decode", (("request", "the request id"), ("reason", "why")), "none",
            "the prefill drops the request's lists and answers `abort-ack` once nothing of it is in flight"),
    Message(Kind.ABORT_ACK, "prefill", (("request", "the request id"), ("fenced", "no write into its pages can land")),
            "none", "the decode may reuse the request's pages once every sender said fenced"),
    Message(Kind.REFUSE, "decode", (("requests", "request ids"), ("reason", "why (an admission bound)")), "none",
            "the prefill drops their lists and reports them refused"),
    Message(Kind.FAILED, "prefill", (("request", "the request id"), ("reason", "why")), "none",
            "the decode fails the request (fenced unless the reason says a write may still land)"),
    Message(Kind.CHECKSUM, "prefill", (("request", "the request id"), ("sum", "the sender's checksum of its bytes")),
            "none", "the decode completes the request only if its own checksum agrees"),
    Message(Kind.STAGED, "prefill",
            (("from", "the sender's id"), ("alignment", "the copy word"), ("requests", "[request, row lo, row hi]"),
             ("waves", "[id, slot offset, row lo, row hi, bytes, notes] per wave")),
            "the run's destination table (uint64 rows)",
            "checked against what the decode published, then each wave is scattered as it lands"),
    Message(Kind.STAGED_PLAN, "prefill",
            (("from", "the sender's id"), ("alignment", "the copy word"),
             ("transfers", "[request, start, fill_len, last] per chunk"), ("run", "the run's id (optional)"),
             ("waves", "as `staged-waves` (optional)")),
            "none", "the decode plans the run's scatter from its own lists, without an address from the sender"),
    Message(Kind.STAGED_WAVES, "prefill",
            (("from", "the sender's id"), ("run", "the run's id"), ("waves", "[id, slot offset, byte lo, byte hi]"),
             ("cancel", "why the run announced by its chunks will not come (instead of waves)")),
            "none", "the waves of a run announced by its chunks, or its withdrawal"),
    Message(Kind.WAVE_DONE, "decode", (("wave", "the wave's id"), ("error", "why it was refused (optional)")), "none",
            "a credit: the wave's slot may be written again (or the run fails with the error)"),
)}


def markdown_table() -> str:
    """docs/transport.md's table of :data:`MESSAGES`."""
    lines = ["| kind | from | header | frames | the receiver |", "|---|---|---|---|---|"]
    for m in MESSAGES.values():
        fields = "; ".join(f"`{name}`: {meaning}" for name, meaning in m.fields)
        lines.append(f"| `{m.kind.value}` | {m.sender} | {fields} | {m.frames} | {m.effect} |")
    return "\n".join(lines)
