"""What a decode endpoint reads from its senders (:class:`SenderMessages`, a part of
:class:`~kvplan.transport.decode.DecodeEndpoint`): one poll of the channels and the engine's notifications,
each note opened and checked against the sender it claims before it counts (its seal, its origin, its
pairing), pairings made again, checksums verified, and a lost sender's requests failed and fenced.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from ..planner.contract.batch import Policy
from .completion import decode_notification
from .control import ControlChannel, ControlTimeout, named_request
from .engines import is_unsafe
from . import auth
from .auth import checksum_key
from .integrity import MASK, published_sums
from .receiver_plan import scatter_source
from .receivers.staged import EARLY_KEEP_S
from .registration import side_from_description, with_model_heads
from .note_seal import key_id_of, seal_of
from .waves import decode_wave_note, is_touch
from .control_messages import Kind

__all__ = ["SenderMessages"]

log = logging.getLogger(__name__)

# how long a sender's lost connection waits before its requests fail: what it sent before it went (its last
# checksums on the socket, its engine's last notifications) is read first, and completes what it completes
GONE_GRACE_S = 0.2


class SenderMessages:
    """The reading half of :class:`~kvplan.transport.decode.DecodeEndpoint` (its state lives on the endpoint)."""

    def _opened(self, raw: bytes) -> tuple[int | None, bytes] | None:
        """An engine notification as ``(sender, note)``: with a secret, the note inside a seal of sender
        ``sender``'s pairing (:mod:`.note_seal`); without one, ``(None, raw)``. ``None``: refused (not
        sealed, sealed by no pairing this side holds, altered or taken before), counted in
        ``notes_refused`` and logged, never acted on."""
        if getattr(self.channels[0], "secret", None) is None:
            return None, raw
        key_id = key_id_of(raw)
        for k, channel in enumerate(self.channels):
            seal = seal_of(channel)
            if seal is not None and key_id == seal.in_id:
                note = seal.open(raw)
                if note is not None:
                    return k, note
                break
        self.notes_refused += 1
        if self.notes_refused & (self.notes_refused - 1) == 0:  # (1, 2, 4, ...: a flood does not flood the log)
            log.error("refused an engine notification that no paired sender sealed, or that was taken before "
                      "(%d so far): %r", self.notes_refused, bytes(raw[:80]))
        return None

    def _foreign(self, origin: str | None, note: Any, sealer: int | None = None) -> str | None:
        """Why a section's notification cannot be its sender's, else ``None``: the sender that sealed it
        (``sealer``), else the engine that sent it as a paired sender's (by the name it gave when
        pairing), is not the sender the note names or one the request was not published to. Unsealed,
        where the engine cannot say who sent it, or two senders share a name, nothing can be checked."""
        senders = [sealer] if sealer is not None else [k for k, name in self._engine_names.items() if name == origin]
        if (origin is None and sealer is None) or len(senders) != 1 or note.request not in self._owner:
            return None
        k = senders[0]
        if note.sender is not None and note.sender != k:
            return f"it names sender {note.sender} but comes from sender {k}"
        if not self._writes(note.request, k):
            return f"request {note.request!r} was not published to sender {k}"
        return None

    def _on_abort_ack(self, peer: int, header: dict[str, Any]) -> None:
        acks = self._fences.get(named_request(header))
        if acks is None or peer not in acks:  # not aborted here, or not this sender's: nothing to fence
            return
        if not self._fence_report(acks, peer, header.get("fenced") is True):
            log.error("request %r: sender %d could not end a write into its pages; they must stay out of use",
                      named_request(header), peer)

    @staticmethod
    def _fence_report(acks: dict[int, bool | None], peer: int, ended: bool) -> bool:
        """Record sender ``peer``'s word on a request's writes (``ended``: none can land any more); whether they
        have ended as far as this side knows. A write reported unsafe stays so: a later report of the request
        (an overload, a queue's deadline, an acknowledgement) does not end a write that may still land."""
        acks[peer] = ended and acks.get(peer) is not False
        return acks[peer]

    def _poll(self) -> None:
        for k, channel in enumerate(self.channels):
            while (msg := channel.try_recv()) is not None:
                self._pause.busy()
                kind, header, frames = msg
                if kind == Kind.STAGED:
                    self._announce(k, header, frames[0])
                elif kind == Kind.STAGED_PLAN:
                    self._announce_planned(k, header)
                elif kind == Kind.STAGED_WAVES:
                    self._on_run_waves(k, header)
                elif kind == Kind.PAIRED:
                    self._on_paired(k, header, frames)
                elif kind == Kind.FAILED and self._writes(request := named_request(header), k):
                    self.tracker.fail(request, f"the prefill side reports: {header.get('reason')}")
                    # it reports once its writes have ended; a write it could not end (a later report may say
                    # so of a request reported before) keeps the pages out of use
                    self._fence_report(self._fence_of(request), k, not is_unsafe(header.get("reason")))
                elif kind == Kind.REFUSED:
                    self._refused[k] = f"the prefill side refused the pairing: {header.get('reason')}"
                    self._fail_owned(k, self._refused[k])
                elif kind == Kind.ABORT_ACK:
                    self._on_abort_ack(k, header)
                elif kind == Kind.CHECKSUM and self._writes(request := named_request(header), k):
                    if isinstance(header.get("sum"), int):
                        self._sums.setdefault(request, {})[k] = header["sum"] & MASK
        took = False  # whether anything arrived or moved this turn (then the wait loop stays hot)
        for origin, raw in self.engine.notifications():
            took = True
            if (opened := self._opened(raw)) is None:
                continue
            sealer, raw = opened
            if is_touch(raw):  # a sender's warm-up write (PrefillEndpoint.warm_up): nothing of a request
                continue
            try:
                wave = decode_wave_note(raw)
                note = decode_notification(raw) if wave is None else None
            except (ValueError, KeyError, TypeError, OverflowError) as err:  # a peer's malformed bytes: dropped, never a crash
                log.warning("dropped a malformed engine notification (%s: %s): %r", type(err).__name__, err,
                            bytes(raw[:80]))
                continue
            if wave is None:
                if (why := self._foreign(origin, note, sealer)) is not None:
                    log.error("dropped a section notification from engine %r: %s", origin, why)
                    continue
                self.tracker.on_section(note)
            elif sealer is not None and wave in self._waves and self._waves[wave].peer != sealer:
                log.error("dropped a wave notification sealed by sender %d for sender %d's wave %s", sealer,
                          self._waves[wave].peer, wave)
            elif wave in self._waves:
                self._waves[wave].landed = True
                self._mark(wave, "landed")
            else:  # its table is sent first but may still be on the socket
                self._early[wave] = time.monotonic()
        if self._runs:
            self._advance_runs()
        self._scatter_landed()
        finished = self._finish_scatters()
        if self._sums:
            finished = self._verify() or finished
        if took or finished or self._runs or any(w.event is not None for w in self._waves.values()):
            self._pause.busy()  # (a scatter or a plan on the device finishes within microseconds)
        if finished and self.tracker.settled():
            return  # what completed the last request is reported at once (the checks below come next turn)
        for k, channel in enumerate(self.channels):
            if channel.replaced():
                self._gone_seen.pop(k, None)
                self._pair_again(k)
            elif channel.peer_gone():
                if time.monotonic() - self._gone_seen.setdefault(k, time.monotonic()) < GONE_GRACE_S:
                    continue  # (looked at again within the pause's longest slice, 4 ms)
                if self._ended(k):  # (a silent one's writes may still land: its fences wait for its word)
                    self._gone_senders.add(k)
                self._fail_owned(k, "the prefill side is gone: its control connection was lost")
                if k in self._credit_to:  # (once) what the engine made to send it credits
                    self.engine.disconnect(self._credit_to.pop(k))
        now = time.monotonic()
        if now - self._checked < ControlChannel.LOOK_S:
            return
        self._checked = now  # deadlines are seconds away: looked at every millisecond, not every turn
        for request in self.tracker.check_deadlines(now):  # its senders are told at once, and must fence it
            self.abort(request, "the decode side's deadline passed before every section arrived")
        if self._early:  # a wave whose table was refused or lost: its note is never claimed
            for key in [k for k, at in self._early.items() if now - at > EARLY_KEEP_S]:
                del self._early[key]

    def _verify(self) -> bool:
        """Check every landed request whose senders' checksums have all come: its own bytes, over what
        this side published, against the sum of theirs (:mod:`.integrity`; one launch for all of them).
        Whether any was checked."""
        ready = []
        for request, sums in list(self._sums.items()):
            if request not in self.tracker or self.tracker.state(request) == "failed":
                del self._sums[request]
            elif len(sums) >= len(self._owner.get(request, ())) and self.tracker.landed(request):
                del self._sums[request]
                partial = [k for k in sums if self._scatter_from.get(k) is not self.side and len(sums) == 1]
                if partial:
                    self.tracker.fail(request, f"integrity: sender {partial[0]}'s bytes do not fill this side's items "
                                               "whole (different page sizes?): its checksum cannot be checked here")
                else:
                    ready.append((request, sum(sums.values()) & MASK))
        mine = published_sums([self.guard.ranges(r) for r, _ in ready], self._device,
                              keys=[self._checksum_key(r) for r, _ in ready])
        for (request, theirs), here in zip(ready, mine):
            if here == theirs:
                self.tracker.verify(request)
            else:
                self.tracker.fail(request, f"integrity: the bytes that landed differ from those sent (checksum "
                                           f"{here:#010x} here, {theirs:#010x} at the sender)")
        return bool(ready)

    def _checksum_key(self, request: Any) -> tuple[int, int] | None:
        """The key of ``request``'s checksum (:func:`.auth.checksum_key`): from the secret its senders paired
        with, for the incarnation this side paired as; ``None`` (unkeyed) without a secret."""
        senders = self._owner.get(request, ())
        channel = self.channels[senders[0]] if senders else None
        secret = getattr(channel, "secret", None)
        # (the incarnation that channel paired as: what its senders derive the key from)
        return None if secret is None else checksum_key(secret, getattr(channel, "incarnation", auth.INCARNATION), request)

    def _on_paired(self, peer: int, header: dict[str, Any], frames: Sequence[bytes] = ()) -> None:
        """A sender's layout, sent once it has paired with this side (a gather needs its rank), and
        where it takes staged credits as engine notifications, its engine metadata."""
        try:
            self._senders[peer] = side_from_description(header["side"])
            self._refused.pop(peer, None)
            if isinstance(header.get("engine"), str):
                self._engine_names[peer] = header["engine"]
            self.side = with_model_heads(self.side, self._senders[peer].kv.num_kv_heads)  # where it named none
            source = scatter_source(self._senders[peer], self.side, Policy.STRICT)
            if source is not None:
                self._scatter_from[peer] = source
        except (KeyError, TypeError, ValueError, OverflowError) as err:
            log.warning("ignored a malformed pairing message from sender %d: %s: %s", peer, type(err).__name__, err)
        incarnation = getattr(self.channels[peer], "peer_incarnation", None)
        if peer in self._resuming:  # paired again after a silence: the same process, whose writes all ended?
            before = self._resuming.pop(peer)
            if before is not None and before == incarnation and header.get("writes_ended") is True:
                self._fence_sender(peer)
        self._sender_inc[peer] = incarnation
        if header.get("credits") == "engine" and frames and self.engine.capabilities.notifies:
            try:
                self._credit_to[peer] = self.engine.connect(frames[0])
            except Exception as err:  # noqa: BLE001 - the engine's own error types: credits then go by channel
                log.error("could not connect to sender %d's engine for its credits: %s: %s", peer,
                          type(err).__name__, err)

    def _pair_again(self, peer: int) -> None:
        """A restarted sender connected on channel ``peer``: what the old one left fails, its staged
        waves are dropped, and the new one gets this side's registration (then new requests)."""
        log.warning("a prefill endpoint connected again on channel %d: registering with it", peer)
        self._fail_owned(peer, "the prefill side is gone: it restarted and connected again")
        if peer in self._gone_senders:  # the one before ended with its process: nothing of it lands any more
            self._fence_sender(peer)
        else:  # it went silent, or this is it again: its fences wait for its word ("writes_ended" once paired)
            self._resuming[peer] = self._sender_inc.get(peer)
        self._gone_senders.discard(peer)  # (the new one is alive: what it is published from now on is its own)
        self._senders.pop(peer, None)  # the new one sends its own layout
        self._engine_names.pop(peer, None)
        self._scatter_from.pop(peer, None)
        self._mirrors.pop(peer, None)
        if peer in self._credit_to:
            self.engine.disconnect(self._credit_to.pop(peer))
        for key in [k for k, w in self._waves.items() if w.peer == peer and w.event is None]:
            del self._waves[key]
        self._runs = [(k, run) for k, run in self._runs if k != peer]
        self._chunked = {key: run for key, run in self._chunked.items() if key[0] != peer}
        try:
            self._register(peer, time.monotonic() + 5.0)
        except ControlTimeout as err:
            log.warning("could not register with the restarted prefill endpoint: %s", err)

    def _fail_owned(self, peer: int, reason: str) -> None:
        for request in self.tracker.pending():
            if self._writes(request, peer):
                self.tracker.fail(request, reason)
                self._fence_of(request)  # (its pages wait for every sender's fence)

    def _fence_sender(self, peer: int) -> None:
        """Nothing sender ``peer`` wrote before can land any more: every fence waiting on it holds."""
        for acks in self._fences.values():
            if acks.get(peer) is None and peer in acks:
                acks[peer] = True
