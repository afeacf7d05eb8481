"""Who is at the other end of a control channel: this process's incarnation, the shared secret, and the
proofs and message codes made from them (:class:`~kvplan.transport.control.ControlChannel` uses them).

**Incarnations.** Every process picks a random :data:`INCARNATION` when kvplan is imported. A channel
is bound to its peer's incarnation when they shake hands; a message that names another sender or
another receiver is refused. A restarted peer is a new incarnation and pairs anew: nothing addressed
to the old one is acted on.

**Authentication** is the default (:func:`channel_secret` says which secret a channel uses: its
``secret`` argument, else ``KVPLAN_SECRET`` or the file ``KVPLAN_SECRET_FILE`` names, else on loopback
this user's per-host secret, :func:`loopback_secret`; off loopback a channel without one does not start,
and only an explicit opt-out, ``KVPLAN_INSECURE`` or an integration's ``insecure`` setting, runs it
open). At the handshake each side sends a fresh nonce and proves that it
holds the secret with an HMAC-SHA256 over its role (the end that listens or connects), both incarnations and
both nonces (:func:`proof`; a hello that names this side's own nonce is refused); from then on
every message carries an HMAC-SHA256, under a key made for that pairing from both nonces, over its
sequence number, both incarnations and every frame. A message whose code does not verify, or whose
sequence number is not above the last one taken, is refused. HMAC rather than ZeroMQ's CURVE: one
shared secret and the standard library, no key pairs to deploy, and a code that binds each message to
the incarnations it was made for, which transport encryption alone would not. Nothing is encrypted:
control messages carry page ids and layouts, not KV bytes, which the engines move on their own paths.
Run open, the handshake still binds incarnations, but anyone who reaches the port can pair.

Example::

    key = pairing_key(secret, (mine, my_nonce), (theirs, their_nonce))   # the same on both sides
    code = message_code(key, envelope, parts)                            # on every message
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import pwd
import secrets
import threading
from typing import Sequence
from .. import env
from ..errors import SettingError
from .control_wire import is_loopback

__all__ = ["INCARNATION", "channel_secret", "checksum_key", "configured_secret", "count_open_channel", "loopback_secret", "message_code", "nonce", "open_channels",
           "pairing_key", "proof", "secret_from_environment", "secret_from_file"]

log = logging.getLogger(__name__)

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


def configured_secret(secret_file: str | None) -> bytes | None:
    """The secret a deployment configured for an integration: its ``secret_file``'s, else
    :func:`secret_from_environment`'s, else ``None`` (its channels then take the loopback secret, or refuse
    to start off loopback unless run open: :func:`channel_secret`)."""
    return secret_from_file(secret_file) if secret_file else secret_from_environment()


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


_lock = threading.Lock()
_loopback: dict[str, bytes] = {}  # loopback secrets read, by path (read once a process)
_warned_open: set[str] = set()  # hosts whose open channels were logged
_opened = 0  # control channels this process made open (an explicit opt-out, no secret)


def open_channels() -> int:
    """How many control channels this process made without a secret, by the explicit opt-out (the metrics'
    ``kvplan_open_channels_total``)."""
    return _opened


def count_open_channel() -> None:
    """One more control channel of this process runs open (:class:`~.control.ControlChannel` says so)."""
    global _opened
    with _lock:
        _opened += 1


def channel_secret(host: str, secret: bytes | None = None, *, insecure: bool = False) -> bytes | None:
    """The secret a control channel on ``host`` proves and codes its messages with: ``secret`` if given,
    else ``KVPLAN_SECRET`` or ``KVPLAN_SECRET_FILE`` (:func:`secret_from_environment`); else, with the
    explicit opt-out (``insecure``, an integration's setting, or ``KVPLAN_INSECURE``), none: the channel
    runs open, which is logged once a host (and counted by the channel, :func:`open_channels`); else, on loopback, this
    user's per-host secret (:func:`loopback_secret`): two processes of one user on one host pair without
    configuration, and no other user's can. Off loopback with none of these, :class:`SettingError`: an
    endpoint reachable from the network does not start open by default.

    Example::

        channel_secret("127.0.0.1")              # this user's loopback secret
        channel_secret("10.0.0.3")               # KVPLAN_SECRET's, or SettingError
    """
    if secret is not None:
        return secret
    configured = secret_from_environment()
    if configured is not None:
        return configured
    if insecure or env.enabled("KVPLAN_INSECURE"):
        with _lock:
            first = host not in _warned_open
            _warned_open.add(host)
        if first:
            log.warning("control channels on %s run open (KVPLAN_INSECURE or the integration's insecure setting): "
                        "any process that reaches the port can pair, be sent KV and complete requests", host)
        return None
    if is_loopback(host):
        return loopback_secret()
    raise SettingError("KVPLAN_SECRET", f"a control channel on {host} (not loopback) has no shared secret: set "
                       "KVPLAN_SECRET_FILE (a file of this user's, mode 600) or KVPLAN_SECRET, or the integration's "
                       "secret_file, to the same secret on every node; KVPLAN_INSECURE=1 runs it open instead "
                       "(anyone who reaches the port can pair and be sent KV)")


def _default_loopback_path() -> str:
    # the home the password database names, not $HOME: every process of the user finds the same file
    # whatever its environment (an engine's workers, a service manager's)
    try:
        home = pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        home = os.path.expanduser("~")
    return os.path.join(home, ".cache", "kvplan", "loopback-secret")


def loopback_secret(path: str | None = None) -> bytes:
    """This user's secret for control channels on loopback, from the file at ``path`` (default:
    ``KVPLAN_LOOPBACK_SECRET_FILE``, else ``~/.cache/kvplan/loopback-secret`` in the home the password
    database names). The first process that needs it creates it: 32 random bytes, hex, in a file of mode
    600 (its folder 700) put in place whole (linked, so that two processes creating it at once end with
    one secret). A file or folder that others may write, or another user owns, is refused
    (:class:`SettingError`): whoever can change the secret can pair.

    Example::

        loopback_secret()                       # the same bytes in every process of this user
    """
    path = path or env.get("KVPLAN_LOOPBACK_SECRET_FILE") or _default_loopback_path()
    with _lock:
        if path in _loopback:
            return _loopback[path]
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        info = os.stat(folder)
        if info.st_uid != os.geteuid() or info.st_mode & 0o022:
            raise SettingError("KVPLAN_LOOPBACK_SECRET_FILE", f"the loopback secret's folder {folder} is not this "
                               f"user's alone (owner {info.st_uid}, mode {info.st_mode & 0o777:o}): others could replace "
                               "the secret; name a file in a private folder with KVPLAN_LOOPBACK_SECRET_FILE, or set "
                               "KVPLAN_SECRET_FILE")
        if not os.path.exists(path):
            _create_secret_file(path)
        value = secret_from_file(path)
    except OSError as err:
        raise SettingError("KVPLAN_LOOPBACK_SECRET_FILE", f"no loopback secret at {path}: {err}; name a file this "
                           "user can create with KVPLAN_LOOPBACK_SECRET_FILE, or set KVPLAN_SECRET_FILE") from err
    except ValueError as err:  # secret_from_file: not private, or empty
        raise SettingError("KVPLAN_LOOPBACK_SECRET_FILE", f"the loopback secret {path} cannot be used: {err}") from err
    with _lock:
        first = path not in _loopback
        _loopback[path] = value
    if first:
        log.debug("control channels on loopback prove this user's secret in %s", path)
    return value


def _create_secret_file(path: str) -> None:
    """A new secret at ``path``, written in full under another name and then linked in: a process never reads
    a half-written secret, and of two that create it at once the second keeps the first one's."""
    draft = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
    descriptor = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.write(descriptor, secrets.token_hex(32).encode() + b"\n")
        finally:
            os.close(descriptor)
        try:
            os.link(draft, path)
        except FileExistsError:
            pass
    finally:
        os.unlink(draft)


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
