"""Who is at the other end of a control channel: this process's incarnation, the shared secret, and the
proofs and message codes made from them (:class:`~kvplan.transport.control.ControlChannel` uses them).

**Incarnations.** Every process picks a random :data:`INCARNATION` when kvplan is imported. A channel
is bound to its peer's incarnation when they shake hands; a message that names another sender or
another receiver is refused. A restarted peer is a new incarnation and pairs anew: nothing addressed
to the old one is acted on.

**Authentication** (with a secret: ``KVPLAN_SECRET``, or the file ``KVPLAN_SECRET_FILE`` names, or the
channel's ``secret`` argument). At the handshake each side sends a fresh nonce and proves that it
holds the secret with an HMAC-SHA256 over its role (the end that listens or connects), both incarnations and
both nonces (:func:`proof`; a hello that names this side's own nonce is refused); from then on
every message carries an HMAC-SHA256, under a key made for that pairing from both nonces, over its
sequence number, both incarnations and every frame. A message whose code does not verify, or whose
sequence number is not above the last one taken, is refused. HMAC rather than ZeroMQ's CURVE: one
shared secret and the standard library, no key pairs to deploy, and a code that binds each message to
the incarnations it was made for, which transport encryption alone would not. Nothing is encrypted:
control messages carry page ids and layouts, not KV bytes, which the engines move on their own paths.
Without a secret the handshake still binds incarnations, but anyone who reaches the port can pair.

Example::

    key = pairing_key(secret, (mine, my_nonce), (theirs, their_nonce))   # the same on both sides
    code = message_code(key, envelope, parts)                            # on every message
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from typing import Sequence
from .. import env

__all__ = ["INCARNATION", "checksum_key", "message_code", "nonce", "pairing_key", "proof", "secret_from_environment", "secret_from_file"]

INCARNATION = secrets.token_hex(8)  # this process's, for its whole life (read as ``auth.INCARNATION``: see below)


def _new_incarnation() -> None:
    """A forked child is another process: it gets an incarnation of its own, so that nothing one says (a
    "writes ended", a sealed note) is taken as the other's."""
    global INCARNATION
    INCARNATION = secrets.token_hex(8)


os.register_at_fork(after_in_child=_new_incarnation)


def nonce() -> str:
    """A fresh random challenge for one handshake."""
    return secrets.token_hex(16)


def secret_from_environment() -> bytes | None:
    """``KVPLAN_SECRET``, else the contents of the file ``KVPLAN_SECRET_FILE`` names (surrounding
    whitespace dropped), else ``None``. An empty secret is refused: it would authenticate anyone."""
    value = env.get("KVPLAN_SECRET")
    if value is None and env.get("KVPLAN_SECRET_FILE"):
        return secret_from_file(env.get("KVPLAN_SECRET_FILE"))
    if value is None:
        return None
    if not value.strip():
        raise ValueError("KVPLAN_SECRET is empty: an empty secret authenticates anyone")
    return value.encode()


def secret_from_file(path: str) -> bytes:
    """The secret in the file at ``path`` (surrounding whitespace dropped; an empty one is refused, and so is
    a file that another user owns or that others than its owner may read or write). An integration's
    ``secret_file`` setting names such a file: a secret is never a value of a config that engines log.

    Example::

        ControlChannel(host="10.0.0.3", secret=secret_from_file("/run/secrets/kvplan"))
    """
    why = env.not_private(path)
    if why is not None:
        raise ValueError(f"the secret file {path} is not private to this user: {why}")
    with open(path, "rb") as source:
        value = source.read().strip()
    if not value:
        raise ValueError(f"the secret file {path} is empty: an empty secret authenticates anyone")
    return value


def proof(secret: bytes, role: str, prover: str, verifier: str, prover_nonce: str, challenge: str) -> str:
    """What ``prover`` sends to show ``verifier`` that it holds ``secret``, for ``verifier``'s nonce
    ``challenge``. The proof names the prover's ``role`` (``"bound"`` or ``"connecting"``: the end that
    listens or the one that connects) and its own nonce too, so that no proof a side makes is one it would
    take: an end that answers a stranger's hello cannot have its answer sent back to it as the stranger's
    proof (a reflection), since that proof names its own role, and the stranger's hello cannot name this
    side's own nonce (refused at the hello)."""
    if role not in ("bound", "connecting"):
        raise ValueError(f"a proof's role is 'bound' or 'connecting', not {role!r}")
    message = f"kvplan-proof-2|{role}|{prover}|{verifier}|{prover_nonce}|{challenge}"
    return hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()


def pairing_key(secret: bytes, mine: tuple[str, str], theirs: tuple[str, str]) -> bytes:
    """The message key of one pairing, from each side's ``(incarnation, nonce)``."""
    first, second = sorted([mine, theirs])
    return hmac.new(secret, f"kvplan-key|{first[0]}|{first[1]}|{second[0]}|{second[1]}".encode(),
                    hashlib.sha256).digest()


def checksum_key(secret: bytes, receiver: str, request: str | int) -> tuple[int, int]:
    """The integrity checksum's key ``(ka, kb)`` (32 bits each, :mod:`kvplan.kernels.checksum`) for
    ``request`` published by the decode incarnation ``receiver``: every sender of the request derives
    the same one from the secret (a TP gather's sums still add up), and no one without it can."""
    digest = hmac.new(secret, f"kvplan-checksum|{receiver}|{json.dumps(request)}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:8], "little")


def message_code(key: bytes, envelope: bytes, parts: Sequence[bytes]) -> bytes:
    """HMAC-SHA256 over a message's envelope (sender, receiver, sequence number) and every part, each
    part's length first (no two splits of the same bytes share a code)."""
    mac = hmac.new(key, envelope, hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac.digest()
