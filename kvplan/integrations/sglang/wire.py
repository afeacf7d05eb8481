"""SGLang's control messages (0.5.23, Mooncake and NIXL transfer backends), encoded and parsed by kvplan.

A decode rank sends the prefill two kinds of ZeroMQ multipart messages:

* a **registration** once per peer (``build_receiver_registration_message``; the prefill reads it
  with ``KVArgsRegisterInfo.from_zmq``): where its buffers are, its TP place, item lengths;
* a **transfer request** per request (``build_receiver_metadata_message``; read with
  ``TransferInfo.from_zmq``): the destination pages, aux row, state lists and decode prefix.

The prefill answers each request with **status** messages (``_encode_kv_status_message``, read with
``parse_kv_status_message``): the room, its ``KVPoll`` state and the sending prefill rank. Mooncake
sends three frames; NIXL tags them ``KV_STATUS`` and adds a failure reason (:data:`STATUS_FRAMING`).
A decode that drops a request sends an **abort** (``AbortNotification``), with where to acknowledge
it and the abort's generation; the prefill answers with an **abort ack** (``AbortAck``) once nothing
more of the request will be written.

:func:`registration_frames` / :func:`transfer_frames` write them as SGLang's decode would;
:func:`parse_registration` / :func:`parse_transfer` read them as SGLang's prefill would, but
strictly: a field of the wrong size or an unparsable number is a :class:`~kvplan.errors.PeerError`
naming the field, where SGLang would read short or raise from deep inside ``struct``. Integers are
little-endian (SGLang packs pointers with the native ``"Q"``: the same bytes on every platform it
runs on).

Each takes the transfer ``backend`` (:data:`BACKENDS`). NIXL's messages start with a guard frame and
order their fields otherwise; its registration also carries the decode's NIXL agent (its name is the
session id, its metadata :attr:`Registration.agent_metadata`), GPU, memory kinds and pool sizes.

Example::

    frames = transfer_frames(TransferRequest(room=7, endpoint="127.0.0.1", port=17000, session_id="127.0.0.1:17001",
                                             dst_pages=np.array([3, 4], np.int32), aux_index=2))
    TransferInfo.from_zmq(frames)          # SGLang's own parser reads it
    parse_transfer(frames).dst_pages       # array([3, 4], dtype=int32)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ...compat.sglang import pack_int_lists, unpack_int_lists
from ...errors import KvplanError, PeerError

__all__ = ["BACKENDS", "FAILED", "KV_POLL_STATES", "SUCCESS", "WAITING_FOR_INPUT", "STATUS_FRAMING", "Abort", "AbortAck", "Registration",
           "StatusMessage", "TransferRequest", "abort_ack_frames", "abort_frames", "is_registration",
           "parse_abort", "parse_abort_ack", "parse_registration", "parse_status", "parse_transfer",
           "registration_frames", "status_frames", "transfer_frames"]

REGISTRATION_FIELDS = 20  # frames in 0.5.23's registration (the staging and DCP fields included)
TRANSFER_FIELDS = 10
KV_POLL_STATES = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}  # KVPoll
FAILED, WAITING_FOR_INPUT, SUCCESS = 0, 2, 4  # the KVPoll states a prefill reports in its status messages
# per transfer backend, a status message's leading tag (or none) and whether it carries a failure reason
STATUS_FRAMING: dict[str, tuple[bytes | None, bool]] = {"mooncake": (None, False), "nixl": (b"KV_STATUS", True)}
BACKENDS = tuple(STATUS_FRAMING)
NIXL_GUARD = b"NixlMsgGuard"  # the first frame of NIXL's registrations and transfer requests


@dataclass(frozen=True)
class Registration:
    """A decode rank's registration: its endpoint, buffers and TP place.

    SGLang's Mooncake registration carries no pool sizes, only base pointers and item lengths: a
    prefill that reads one cannot bound-check destination pages against the decode's pools. NIXL's
    carries the KV pool's slot count (``num_slots``) and the state buffers' lengths, and the decode's
    NIXL agent: ``session_id`` is its name, ``agent_metadata`` what ``add_remote_agent`` takes, on
    GPU ``gpu_id``, with each KV buffer's memory kind (``kv_mem_kinds``: ``"VRAM"`` or ``"DRAM"``).
    """

    endpoint: str
    port: int
    session_id: str
    kv_ptrs: tuple[int, ...]
    kv_item_lens: tuple[int, ...]
    aux_ptrs: tuple[int, ...]
    tp_rank: int
    attn_tp_size: int
    state_ptrs: tuple[tuple[int, ...], ...] = ()
    state_item_lens: tuple[tuple[int, ...], ...] = ()
    state_dim_per_tensor: tuple[tuple[int, ...], ...] = ()
    kv_layer_ids: tuple[int, ...] = ()
    state_layer_ids: tuple[tuple[int, ...], ...] = ()
    dcp_size: int = 1
    dcp_rank: int = 0
    agent_metadata: bytes = b""
    gpu_id: int = 0
    kv_mem_kinds: tuple[str, ...] = ()
    num_slots: int | None = None
    state_data_lens: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class TransferRequest:
    """One request's destination as a decode rank sends it (``is_dummy``: a rank that receives
    nothing for this request, but must be counted)."""

    room: int
    endpoint: str
    port: int
    session_id: str
    dst_pages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    aux_index: int | None = None
    state_lists: Sequence[Sequence[int]] = ()
    required_dst_info_num: int = 1
    decode_prefix_len: int = 0
    is_dummy: bool = False


@dataclass(frozen=True)
class StatusMessage:
    """A prefill rank's status of one request for a decode rank: ``status`` is a ``KVPoll`` value
    (:data:`KV_POLL_STATES`); ``reason`` says why it failed, where the backend carries one."""

    room: int
    status: int
    prefill_rank: int
    reason: str | None = None


@dataclass(frozen=True)
class Abort:
    """A decode rank's abort of one request (``room``). With ``decode_ip`` and ``decode_port`` the
    prefill acknowledges it there once nothing more will be written, naming ``generation``."""

    room: int
    decode_ip: str | None = None
    decode_port: int | None = None
    generation: int | None = None


@dataclass(frozen=True)
class AbortAck:
    """A prefill rank's answer to an :class:`Abort`: nothing more of ``room`` will be written."""

    room: int
    prefill_rank: int
    generation: int | None = None


ABORT_TAG, ABORT_ACK_TAG = b"ABORT", b"ABORT_ACK"


def _ascii(value: object) -> bytes:
    return str(value).encode("ascii")


def _words(values: Sequence[int], fmt: str) -> bytes:
    return np.asarray(values, dtype=np.dtype(fmt)).tobytes()


def _backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"no SGLang framing for backend {backend!r}; known: {list(BACKENDS)}")
    return backend


def registration_frames(reg: Registration, backend: str = "mooncake") -> list[bytes]:
    """The registration frames, in 0.5.23's order for ``backend`` (no staging buffer)."""
    if _backend(backend) == "nixl":
        kinds = reg.kv_mem_kinds or ("VRAM",) * len(reg.kv_ptrs)
        return [NIXL_GUARD, b"None", reg.endpoint.encode("ascii"), _ascii(reg.port), reg.session_id.encode("ascii"),
                bytes(reg.agent_metadata), _words(reg.kv_ptrs, "<u8"), _words(reg.aux_ptrs, "<u8"),
                pack_int_lists(reg.state_ptrs, "Q"), _ascii(reg.gpu_id), _ascii(reg.attn_tp_size), _ascii(reg.tp_rank),
                _ascii(reg.kv_item_lens[0] if reg.kv_item_lens else 0), pack_int_lists(reg.state_item_lens, "I"),
                pack_int_lists(reg.state_dim_per_tensor, "I"), b"", b"",
                _ascii(reg.num_slots if reg.num_slots is not None else 0), ",".join(kinds).encode("ascii"),
                _words(reg.kv_item_lens, "<u8"), pack_int_lists(reg.state_layer_ids, "I"),
                _words(reg.kv_layer_ids, "<u4"), _ascii(reg.dcp_size), _ascii(reg.dcp_rank),
                pack_int_lists(reg.state_data_lens, "Q")]
    return [b"None", reg.endpoint.encode("ascii"), _ascii(reg.port), reg.session_id.encode("ascii"),
            _words(reg.kv_ptrs, "<u8"), _words(reg.aux_ptrs, "<u8"), pack_int_lists(reg.state_ptrs, "Q"),
            _ascii(reg.tp_rank), _ascii(reg.attn_tp_size), _ascii(reg.kv_item_lens[0] if reg.kv_item_lens else 0),
            pack_int_lists(reg.state_item_lens, "I"), pack_int_lists(reg.state_dim_per_tensor, "I"),
            _words(reg.kv_layer_ids, "<u4"), pack_int_lists(reg.state_layer_ids, "I"), b"", b"",
            _ascii(reg.dcp_size), _ascii(reg.dcp_rank), b"", _words(reg.kv_item_lens, "<u8")]


def transfer_frames(req: TransferRequest, backend: str = "mooncake") -> list[bytes]:
    """A transfer request's frames, in 0.5.23's order for ``backend``."""
    dummy = req.is_dummy
    state = pack_int_lists(req.state_lists, "i") if not dummy and req.state_lists else b""
    if _backend(backend) == "nixl":
        return [NIXL_GUARD, _ascii(req.room), req.endpoint.encode("ascii"), _ascii(req.port),
                req.session_id.encode("ascii"), b"" if dummy else np.asarray(req.dst_pages, dtype="<i4").tobytes(),
                _ascii(req.aux_index), _ascii(req.required_dst_info_num), state, _ascii(req.decode_prefix_len or 0),
                _ascii(int(dummy))]
    return [_ascii(req.room), req.endpoint.encode("ascii"), _ascii(req.port), req.session_id.encode("ascii"),
            b"" if dummy else np.asarray(req.dst_pages, dtype="<i4").tobytes(),
            b"" if dummy else _ascii(req.aux_index), state, _ascii(req.required_dst_info_num),
            _ascii(req.decode_prefix_len or 0), b""]


def _framing(backend: str) -> tuple[bytes | None, bool]:
    try:
        return STATUS_FRAMING[backend]
    except KeyError:
        raise ValueError(f"no status framing for backend {backend!r}; known: {sorted(STATUS_FRAMING)}") from None


def status_frames(msg: StatusMessage, backend: str = "mooncake") -> list[bytes]:
    """A status message's frames as ``backend``'s prefill sends them (the reason only where it carries one)."""
    tag, carries_reason = _framing(backend)
    frames = [_ascii(msg.room), _ascii(msg.status), _ascii(msg.prefill_rank)]
    if carries_reason:
        frames.append((msg.reason or "").encode("utf-8"))
    return ([tag] if tag is not None else []) + frames


def parse_status(frames: Sequence[bytes], backend: str = "mooncake") -> StatusMessage | None:
    """A status message (SGLang's or :func:`status_frames`'), checked; ``None`` for a message of
    another kind (``backend`` tags its status messages and this one has another tag). Raises
    :class:`~kvplan.errors.PeerError` naming the field for a malformed one, or an unknown state."""
    tag, _ = _framing(backend)
    frames = list(frames)
    if tag is not None:
        if not frames or bytes(frames[0]) != tag:
            return None
        frames = frames[1:]
    f = _Frames(frames, "an SGLang status message", 3)
    status = f.integer(1, "status")
    if status not in KV_POLL_STATES:
        raise PeerError(f"an SGLang status message: status {status} is no KVPoll state")
    try:
        reason = f.get(3).decode("utf-8") or None
    except UnicodeDecodeError:
        raise PeerError("an SGLang status message: the failure reason is not UTF-8") from None
    return StatusMessage(f.integer(0, "room"), status, f.integer(2, "prefill_rank"), reason)


def abort_frames(abort: Abort) -> list[bytes]:
    """An abort's frames as SGLang's decode sends them (``AbortNotification.to_zmq``)."""
    frames = [ABORT_TAG, _ascii(abort.room)]
    if abort.decode_ip is not None and abort.decode_port is not None:
        frames += [abort.decode_ip.encode("ascii"), _ascii(abort.decode_port)]
        if abort.generation is not None:
            frames.append(_ascii(abort.generation))
    return frames


def abort_ack_frames(ack: AbortAck) -> list[bytes]:
    """An abort ack's frames as SGLang's prefill sends them (``AbortAck.to_zmq``)."""
    frames = [ABORT_ACK_TAG, _ascii(ack.room), _ascii(ack.prefill_rank)]
    return frames + ([_ascii(ack.generation)] if ack.generation is not None else [])


def parse_abort(frames: Sequence[bytes]) -> Abort | None:
    """An abort (SGLang's or :func:`abort_frames`'), checked; ``None`` for a message of another kind.
    Raises :class:`~kvplan.errors.PeerError` naming the field: where SGLang keeps the room of an abort
    whose return address or generation is malformed, and drops the rest, kvplan refuses the message."""
    if not frames or bytes(frames[0]) != ABORT_TAG:
        return None
    f = _Frames(frames, "an SGLang abort", 2)
    if len(f.frames) not in (2, 4, 5):
        raise PeerError(f"an SGLang abort: {len(f.frames)} frames, 2, 4 or 5 expected")
    if len(f.frames) == 2:
        return Abort(f.integer(1, "room"))
    port = f.integer(3, "decode_port")
    if not 0 < port < 65536:
        raise PeerError(f"an SGLang abort: decode_port {port} is no TCP port")
    return Abort(f.integer(1, "room"), f.text(2, "decode_ip"), port,
                 f.integer(4, "generation") if len(f.frames) == 5 else None)


def parse_abort_ack(frames: Sequence[bytes]) -> AbortAck | None:
    """An abort ack (SGLang's or :func:`abort_ack_frames`'), checked; ``None`` for another kind."""
    if not frames or bytes(frames[0]) != ABORT_ACK_TAG:
        return None
    f = _Frames(frames, "an SGLang abort ack", 3)
    return AbortAck(f.integer(1, "room"), f.integer(2, "prefill_rank"),
                    f.integer(3, "generation") if len(f.frames) > 3 else None)


class _Frames:
    """Field access that names what is wrong (a peer's message is never trusted)."""

    def __init__(self, frames: Sequence[bytes], what: str, needed: int):
        self.frames, self.what = [bytes(f) for f in frames], what
        if len(self.frames) < needed:
            raise PeerError(f"{what}: {len(self.frames)} frames, at least {needed} expected")

    def get(self, i: int) -> bytes:
        return self.frames[i] if i < len(self.frames) else b""

    def text(self, i: int, name: str) -> str:
        try:
            return self.get(i).decode("ascii")
        except UnicodeDecodeError:
            raise PeerError(f"{self.what}: field {name} is not ASCII") from None

    def integer(self, i: int, name: str, default: int | None = None) -> int:
        raw = self.text(i, name)
        if raw == "" and default is not None:
            return default
        try:
            return int(raw)
        except ValueError:
            raise PeerError(f"{self.what}: field {name} is not an integer: {raw[:40]!r}") from None

    def array(self, i: int, name: str, dtype: str) -> np.ndarray:
        raw, size = self.get(i), np.dtype(dtype).itemsize
        if len(raw) % size:
            raise PeerError(f"{self.what}: field {name} holds {len(raw)} bytes, not whole {size}-byte items")
        return np.frombuffer(raw, dtype=dtype)

    def lists(self, i: int, name: str, fmt: str) -> tuple[tuple[int, ...], ...]:
        try:
            return tuple(tuple(x) for x in unpack_int_lists(self.get(i), fmt))
        except KvplanError as err:
            raise PeerError(f"{self.what}: field {name}: {err}") from None


def is_registration(frames: Sequence[bytes], backend: str = "mooncake") -> bool:
    """Whether a decode rank's message (not an abort) is a registration rather than a transfer request."""
    at = 1 if _backend(backend) == "nixl" else 0
    return len(frames) > at and bytes(frames[at]) == b"None"


def _unguarded(frames: Sequence[bytes], backend: str, what: str) -> list[bytes]:
    """``frames`` without NIXL's guard frame (which a NIXL message must have)."""
    frames = [bytes(x) for x in frames]
    if _backend(backend) != "nixl":
        return frames
    if not frames or frames[0] != NIXL_GUARD:
        raise PeerError(f"{what}: no {NIXL_GUARD.decode()} frame first")
    return frames[1:]


def parse_registration(frames: Sequence[bytes], backend: str = "mooncake") -> Registration:
    """A decode rank's registration frames (SGLang's or :func:`registration_frames`'), checked."""
    if backend == "nixl":
        return _parse_nixl_registration(_unguarded(frames, backend, "an SGLang registration"))
    _backend(backend)
    f = _Frames(frames, "an SGLang registration", 10)
    kv_ptrs = tuple(int(x) for x in f.array(4, "kv_ptrs", "<u8"))
    return Registration(
        endpoint=f.text(1, "endpoint"), port=f.integer(2, "port"), session_id=f.text(3, "session_id"),
        kv_ptrs=kv_ptrs, kv_item_lens=_kv_item_lens(f, len(kv_ptrs), 19, 9),
        aux_ptrs=tuple(int(x) for x in f.array(5, "aux_ptrs", "<u8")),
        tp_rank=f.integer(7, "tp_rank"), attn_tp_size=f.integer(8, "attn_tp_size"),
        state_ptrs=f.lists(6, "state_ptrs", "Q"), state_item_lens=f.lists(10, "state_item_lens", "I"),
        state_dim_per_tensor=f.lists(11, "state_dim_per_tensor", "I"),
        kv_layer_ids=tuple(int(x) for x in f.array(12, "kv_layer_ids", "<u4")),
        state_layer_ids=f.lists(13, "state_layer_ids", "I"), dcp_size=f.integer(16, "dcp_size", 1),
        dcp_rank=f.integer(17, "dcp_rank", 0))


def _kv_item_lens(f: "_Frames", ptrs: int, at: int, one_at: int) -> tuple[int, ...]:
    lens = tuple(int(x) for x in f.array(at, "kv_item_lens", "<u8"))
    if lens and len(lens) != ptrs:
        raise PeerError(f"{f.what}: {ptrs} KV pointers but {len(lens)} item lengths")
    return lens or (f.integer(one_at, "kv_item_len"),) * ptrs  # older senders: one item length for all


def _parse_nixl_registration(frames: list[bytes]) -> Registration:
    f = _Frames(frames, "an SGLang NIXL registration", 12)
    kv_ptrs = tuple(int(x) for x in f.array(5, "kv_ptrs", "<u8"))
    kinds = tuple(k for k in f.text(17, "kv_mem_kinds").split(",") if k) or ("VRAM",) * len(kv_ptrs)
    if len(kinds) != len(kv_ptrs) or not set(kinds) <= {"VRAM", "DRAM"}:
        raise PeerError(f"{f.what}: field kv_mem_kinds {kinds[:4]} does not give VRAM or DRAM for each of "
                        f"{len(kv_ptrs)} KV pointers")
    slots = f.integer(16, "num_slots", 0)
    return Registration(
        endpoint=f.text(1, "endpoint"), port=f.integer(2, "port"), session_id=f.text(3, "agent_name"),
        kv_ptrs=kv_ptrs, kv_item_lens=_kv_item_lens(f, len(kv_ptrs), 18, 11),
        aux_ptrs=tuple(int(x) for x in f.array(6, "aux_ptrs", "<u8")), tp_rank=f.integer(10, "tp_rank"),
        attn_tp_size=f.integer(9, "attn_tp_size"), state_ptrs=f.lists(7, "state_ptrs", "Q"),
        state_item_lens=f.lists(12, "state_item_lens", "I"),
        state_dim_per_tensor=f.lists(13, "state_dim_per_tensor", "I"),
        kv_layer_ids=tuple(int(x) for x in f.array(20, "kv_layer_ids", "<u4")),
        state_layer_ids=f.lists(19, "state_layer_ids", "I"), dcp_size=f.integer(21, "dcp_size", 1),
        dcp_rank=f.integer(22, "dcp_rank", 0), agent_metadata=f.get(4), gpu_id=f.integer(8, "gpu_id"),
        kv_mem_kinds=kinds, num_slots=slots or None, state_data_lens=f.lists(23, "state_data_lens", "Q"))


def parse_transfer(frames: Sequence[bytes], backend: str = "mooncake") -> TransferRequest:
    """A transfer request's frames (SGLang's or :func:`transfer_frames`'), checked."""
    if backend == "nixl":
        return _parse_nixl_transfer(_unguarded(frames, backend, "an SGLang transfer request"))
    _backend(backend)
    f = _Frames(frames, "an SGLang transfer request", 8)
    dummy = f.get(4) == b"" and f.get(5) == b""
    return TransferRequest(
        room=f.integer(0, "room"), endpoint=f.text(1, "endpoint"), port=f.integer(2, "port"),
        session_id=f.text(3, "session_id"),
        dst_pages=np.zeros(0, np.int32) if dummy else f.array(4, "dst_pages", "<i4").astype(np.int32),
        aux_index=None if dummy else f.integer(5, "aux_index"),
        state_lists=() if dummy or f.get(6) == b"" else f.lists(6, "state_lists", "i"),
        required_dst_info_num=f.integer(7, "required_dst_info_num"),
        decode_prefix_len=f.integer(8, "decode_prefix_len", 0), is_dummy=dummy)


def _parse_nixl_transfer(frames: list[bytes]) -> TransferRequest:
    f = _Frames(frames, "an SGLang NIXL transfer request", 8)
    prefix = f.integer(8, "decode_prefix_len", 0)
    pages = f.array(4, "dst_pages", "<i4").astype(np.int32)
    flag = f.get(9)
    # as SGLang reads it: the flag where sent; else no pages (and no prefix to explain them) is a dummy
    dummy = bool(f.integer(9, "is_dummy")) if flag else (pages.size == 0 and not prefix)
    return TransferRequest(
        room=f.integer(0, "room"), endpoint=f.text(1, "endpoint"), port=f.integer(2, "port"),
        session_id=f.text(3, "agent_name"), dst_pages=np.zeros(0, np.int32) if dummy else pages,
        aux_index=None if dummy else f.integer(5, "aux_index"),
        state_lists=() if dummy or f.get(7) == b"" else f.lists(7, "state_lists", "i"),
        required_dst_info_num=f.integer(6, "required_dst_info_num"), decode_prefix_len=prefix, is_dummy=dummy)
