"""Engine notifications sealed under a pairing's key: who may say that bytes have landed.

An engine notification tells a decode that a section or a staged wave has landed, and tells a
prefill that a staging slot is free again. The engines carry them without authenticating anyone:
Mooncake takes a notification's sender name from the sender, and any process that reaches an
engine's port can send one (a test showed it: a process that was no paired sender wrote a decode's pages and
sent the notes, and the request completed with no byte from its prefill). With a shared secret each
notification is sealed under a key of the control channel's pairing (:mod:`.auth`) and one direction:

    kvn1 <key id> <counter> <code> <notification>

``key id`` names the sealing key (eight hex digits of an HMAC over it: the receiver picks the
pairing without trying every key), ``counter`` is the sender's count of notes under that key, and
``code`` an HMAC-SHA256 (128 bits) over the counter and the notification. The receiver opens a note
only with the key of a pairing it holds, in the sender's direction; a note whose code does not
verify, of another pairing (a restarted peer's predecessor's), or whose counter it has taken before
is refused, never acted on. Notes of one pairing may arrive out of order (engines deliver them
over several lanes), so the replay guard keeps a window of :data:`WINDOW` counters below the highest
taken: a counter below it is refused too. Without a secret nothing is sealed, as nothing on the
control channel is authenticated either.

Example::

    seal = NoteSeal(key, mine=INCARNATION, theirs=peer_incarnation)   # both sides of one pairing
    raw = seal.seal(b'{"wave": 3, "from": "p0"}')                      # the sender's
    inner = their_seal.open(raw)                                       # the receiver's: bytes, or None
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import threading

__all__ = ["NoteSeal", "WINDOW", "key_id_of", "opened", "seal_of", "sealed"]

PREFIX = b"kvn1 "
WINDOW = 1 << 16  # counters below the highest taken that may still arrive (notes in flight at once)
_CODE_BYTES = 16


def _direction_key(pairing_key: bytes, sender: str) -> bytes:
    """The key of one direction of a pairing: the notes ``sender`` seals (a note reflected back to its
    sender does not open there)."""
    return hmac.new(pairing_key, b"kvplan-note|" + sender.encode(), hashlib.sha256).digest()


def _key_id(key: bytes) -> bytes:
    return hmac.new(key, b"kvplan-note-id", hashlib.sha256).hexdigest()[:8].encode()


def _code(key: bytes, counter: bytes, note: bytes) -> bytes:
    return hmac.new(key, counter + b" " + note, hashlib.sha256).hexdigest()[: 2 * _CODE_BYTES].encode()


def key_id_of(raw: bytes) -> bytes | None:
    """The key id a sealed note names, or ``None`` for a note that is not sealed."""
    if not raw.startswith(PREFIX):
        return None
    end = raw.find(b" ", len(PREFIX))
    return raw[len(PREFIX) : end] if end > 0 else None


class NoteSeal:
    """The seals of one pairing: :meth:`seal` for the notes this side sends, :meth:`open` for the
    peer's (``mine``, ``theirs``: the two incarnations; ``pairing_key``: the channel's).

    Attributes:
        out_id, in_id: the key ids of this side's notes and of the peer's.
        refused: notes :meth:`open` refused (bad code, replayed, too old, malformed).
    """

    def __init__(self, pairing_key: bytes, mine: str, theirs: str):
        self.pairing_key = pairing_key
        self._out, self._in = _direction_key(pairing_key, mine), _direction_key(pairing_key, theirs)
        self.out_id, self.in_id = _key_id(self._out), _key_id(self._in)
        self._count = itertools.count(1)  # (next() is atomic: any thread may seal)
        self._lock = threading.Lock()
        self._highest = 0
        self._taken: set[int] = set()  # counters taken within WINDOW of the highest
        self.refused = 0

    def seal(self, note: bytes) -> bytes:
        """``note`` sealed for the peer (an empty note, which asks the engine to notify nothing, stays empty)."""
        if not note:
            return note
        counter = b"%x" % next(self._count)
        return b" ".join((PREFIX.rstrip(), self.out_id, counter, _code(self._out, counter, note), note))

    def open(self, raw: bytes) -> bytes | None:
        """The note inside ``raw`` if the peer sealed it and it was not taken before, else ``None``."""
        parts = raw.split(b" ", 4)
        if len(parts) != 5 or parts[0] != PREFIX.rstrip() or parts[1] != self.in_id:
            return self._refuse()
        _, _, counter_hex, code, note = parts
        if not hmac.compare_digest(code, _code(self._in, counter_hex, note)):
            return self._refuse()
        try:
            counter = int(counter_hex, 16)
        except ValueError:
            return self._refuse()
        with self._lock:
            if counter <= self._highest - WINDOW or counter in self._taken:
                return self._refuse()
            self._taken.add(counter)
            if counter > self._highest:
                self._highest = counter
                if len(self._taken) > 2 * WINDOW:  # (forget what the window left behind, now and then)
                    self._taken = {c for c in self._taken if c > counter - WINDOW}
        return note

    def _refuse(self) -> None:
        self.refused += 1
        return None


def seal_of(channel: object) -> NoteSeal | None:
    """The :class:`NoteSeal` of a control channel's pairing (:meth:`ControlChannel.note_seal`), or ``None``
    where notes go unsealed: no secret, no pairing yet, or a channel without pairings (tests' in-memory
    ones)."""
    note_seal = getattr(channel, "note_seal", None)
    return None if note_seal is None else note_seal()


def sealed(channel: object, note: bytes) -> bytes:
    """``note`` as the peer of ``channel`` takes it: sealed under the pairing's key where there is a secret,
    else as it is."""
    seal = seal_of(channel)
    return note if seal is None else seal.seal(note)


def opened(channel: object, raw: bytes) -> bytes | None:
    """A notification from the peer of ``channel``: the note inside its seal where there is a secret
    (``None`` if it does not open under the pairing's key, or was taken before), else ``raw``."""
    seal = seal_of(channel)
    return raw if seal is None else seal.open(raw)
