"""With a shared secret, engine notifications are sealed under the pairing's key
(kvplan.transport.note_seal), so a process that is no paired sender cannot complete a request by sending
the notes its prefill would have sent, nor replay a sender's notes, nor seal its own under another key.

Before, over Mooncake, such a process (naming itself as the prefill's engine: Mooncake takes a
notification's sender name from the sender) wrote a decode's pages and sent the notes, and the request
completed with no byte from its prefill. Real Mooncake (TCP), every endpoint in this process."""

from __future__ import annotations

import secrets
import time
import uuid

import numpy as np
import pytest

from kvplan.planner.device.destinations import PreallocatedRequest
from kvplan.tools.load import Arrival, LoadConfig
from kvplan.tools.load_pools import Pools
from kvplan.transport.auth import INCARNATION
from kvplan.transport.control import ControlChannel
from kvplan.transport.endpoints import Chunk, DecodeEndpoint, PrefillEndpoint
from kvplan.transport.engines import make_engine
from kvplan.transport.note_seal import WINDOW, NoteSeal, key_id_of
from tests.transport.pairing import pair as pair_channels

pytestmark = pytest.mark.engines

CONFIG = LoadConfig(layers=2, token_bytes=32, prompt_max=256, rows=4, device="cpu")
SECRET = b"the deployment's secret"


# -- the seal itself --------------------------------------------------------------------------------------
def _pair_of_seals() -> tuple[NoteSeal, NoteSeal]:
    key, a, b = secrets.token_bytes(32), secrets.token_hex(8), secrets.token_hex(8)
    return NoteSeal(key, a, b), NoteSeal(key, b, a)


def test_a_sealed_note_opens_once_on_the_other_side_and_never_on_its_own():
    mine, theirs = _pair_of_seals()
    notes = [b'["r%d", 0, "kv", %d]' % (k, k) for k in range(50)]
    sealed = [mine.seal(n) for n in notes]
    assert all(key_id_of(s) == mine.out_id == theirs.in_id for s in sealed)
    for k in np.random.default_rng().permutation(len(sealed)):  # (engines deliver out of order)
        assert theirs.open(sealed[k]) == notes[k]
    assert [theirs.open(s) for s in sealed[:5]] == [None] * 5  # replayed
    assert mine.open(sealed[0]) is None  # reflected to its sender: the other direction's key
    assert theirs.refused == 5 and mine.refused == 1
    assert mine.seal(b"") == b""  # (an empty notification asks the engine to notify nothing)


def test_any_change_to_a_sealed_note_or_another_pairing_s_key_is_refused():
    mine, theirs = _pair_of_seals()
    other, _ = _pair_of_seals()
    sealed = mine.seal(b'{"wave": 7, "from": "p0"}')
    rng = np.random.default_rng()
    for _ in range(200):
        changed = bytearray(sealed)
        k = int(rng.integers(len(changed)))
        changed[k] ^= int(rng.integers(1, 256))
        assert theirs.open(bytes(changed)) is None, (k, bytes(changed))
    assert theirs.open(other.seal(b'{"wave": 7, "from": "p0"}')) is None
    assert theirs.open(b'{"wave": 7, "from": "p0"}') is None  # not sealed
    assert theirs.open(sealed) is not None  # (the original still opens: none of the above was taken)


def test_a_counter_below_the_window_is_refused():
    mine, theirs = _pair_of_seals()
    first = mine.seal(b"old")
    for _ in range(WINDOW):
        mine.seal(b"skipped")
    assert theirs.open(mine.seal(b"new")) == b"new"
    assert theirs.open(first) is None


# -- through the endpoints, against a process that is no paired sender -----------------------------------
@pytest.fixture(scope="module")
def pair():
    pytest.importorskip("mooncake.engine")
    src, dst = Pools(CONFIG, "cpu", CONFIG.rows), Pools(CONFIG, "cpu", CONFIG.rows)
    channel = ControlChannel(host="127.0.0.1", secret=SECRET)
    name = uuid.uuid4().hex[:8]
    decode = DecodeEndpoint(dst.side, make_engine("mooncake", f"decode-{name}", local_hostname="127.0.0.1"), channel)
    prefill = PrefillEndpoint(src.side, make_engine("mooncake", f"prefill-{name}", local_hostname="127.0.0.1"),
                              ControlChannel(channel.port, host="127.0.0.1", secret=SECRET))
    pair_channels([lambda: decode.register(timeout=10)], [lambda: prefill.accept(timeout=10)])
    stranger = make_engine("mooncake", f"stranger-{name}", local_hostname="127.0.0.1")
    scratch = np.full(64, 7, np.uint8)
    stranger.register([(scratch.ctypes.data, scratch.nbytes)])
    yield prefill, decode, src, dst, stranger, scratch
    for closing in (decode.engine, prefill.engine, stranger, channel, prefill.channel):
        closing.close()


def _publish(pair, request: str, deadline_s: float) -> tuple[Arrival, tuple, tuple]:
    prefill, decode, src, dst, _, _ = pair
    arrival = Arrival(0, request, 0.0, 100, 0, 0, None)
    s_rows, d_rows = src.take(arrival.prompt_len), dst.take(arrival.prompt_len)
    dst.flush()
    decode.publish([PreallocatedRequest(request, d_rows[0], arrival.prompt_len, 0, aux_index=d_rows[0])],
                   timeout=deadline_s)
    prefill.receive_requests(1, timeout=10)
    return arrival, s_rows, d_rows


def _send(pair, arrival: Arrival, s_rows) -> list[bytes]:
    """Send a request as its prefill does; the engine notifications it sent, as they left."""
    prefill, _, src, _, _, _ = pair
    s_row = s_rows[0]
    src.write(arrival, s_row, 0, arrival.prompt_len)
    src.aux[s_row] = arrival.index % 251 + 1
    sent, post = [], prefill.engine.post

    def recording(peer, descs, notification, reuse=None):
        sent.append(notification)
        return post(peer, descs, notification, reuse)

    prefill.engine.post = recording
    try:
        chunk = Chunk(arrival.request, s_row, 0, arrival.prompt_len + 1, arrival.prompt_len, True, s_row)
        assert prefill.send([prefill.transfer(chunk)], mode="direct", timeout=30) == {arrival.request: None}
    finally:
        del prefill.engine.post
    return [n for n in sent if n]


def _notify_as_the_prefill(pair, notes: list[bytes], page_address: int) -> None:
    """The stranger writes 64 bytes into a decode page and sends ``notes``, under the prefill's engine name."""
    prefill, decode, _, _, stranger, scratch = pair
    segment = stranger.connect(decode.engine.metadata())
    for note in notes:
        rc = stranger.engine.batch_transfer_sync(segment, [scratch.ctypes.data], [page_address], [scratch.nbytes],
                                                 stranger._opcode.Write, stranger._notify(prefill.engine.name,
                                                                                          note.decode()))
        assert rc == 0


def test_notes_from_a_process_that_is_no_paired_sender_complete_nothing(pair):
    prefill, decode, src, dst, _, _ = pair
    # a request sent whole, as it should be: its notes are sealed, and it completes
    real, s_rows, d_rows = _publish(pair, "real0", deadline_s=30)
    genuine = _send(pair, real, s_rows)
    assert genuine and all(key_id_of(n) is not None for n in genuine), genuine[:2]
    assert decode.wait() == {"real0": "complete"}
    assert dst.check(real, d_rows[0])
    for rows, pool in ((s_rows, src), (d_rows, dst)):
        pool.give(*rows)
    decode.forget("real0")
    prefill.forget(["real0"])

    page = int(dst.kv[0].data_ptr())
    inner = [n.split(b" ", 4)[4] for n in genuine]
    # 1. the notes its prefill would have sent for another request, unsealed (what completed it before)
    forged, fs_rows, fd_rows = _publish(pair, "forged0", deadline_s=3)
    _notify_as_the_prefill(pair, [n.replace(b'"real0"', b'"forged0"') for n in inner], page)
    # 2. the same request id published again, and its earlier notes replayed as they were sealed
    replayed, rs_rows, rd_rows = _publish(pair, "real0", deadline_s=3)
    _notify_as_the_prefill(pair, genuine, page)
    # 3. sealed, under a key of the stranger's own
    own = NoteSeal(secrets.token_bytes(32), "stranger", INCARNATION)
    _notify_as_the_prefill(pair, [own.seal(n.replace(b'"real0"', b'"forged0"')) for n in inner], page)
    started = time.monotonic()
    states = decode.wait()
    assert states == {"forged0": "failed", "real0": "failed"}, states
    assert time.monotonic() - started > 1.0  # (they failed at their deadlines, not on a refused note)
    assert all("deadline" in decode.failures[r] for r in states), decode.failures
    assert decode.notes_refused >= 3 * len(genuine)
    for rows, pool in ((fs_rows, src), (fd_rows, dst), (rs_rows, src), (rd_rows, dst)):
        pool.give(*rows)
    ends = time.monotonic() + 10
    while len(prefill.aborted) < 2 and time.monotonic() < ends:  # (the decode's aborts, read and acknowledged)
        prefill.progress()
        time.sleep(0.01)
    for request in states:
        decode.forget(request)
        prefill.forget([request])

    # the pairing goes on: the next request sent by its prefill completes
    after, s_rows, d_rows = _publish(pair, "after0", deadline_s=30)
    _send(pair, after, s_rows)
    assert decode.wait() == {"after0": "complete"}
    assert dst.check(after, d_rows[0])
