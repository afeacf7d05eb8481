"""Opt-in integrity: per-request checksums computed on both sides, compared when
a request has landed. A flipped byte fails its request with the reason; the others complete. Real
Mooncake (TCP), both endpoints in this process (one pair for the module), kernels interpreted on
the CPU."""

import time
import uuid

import pytest

from kvplan.planner.device.destinations import PreallocatedRequest
from kvplan.tools.load import Arrival, LoadConfig
from kvplan.tools.load_pools import Pools
from kvplan.transport.control import ControlChannel
from tests.transport.pairing import pair as pair_channels
from kvplan.transport.endpoints import Chunk, DecodeEndpoint, PrefillEndpoint
from kvplan.transport.engines import make_engine

pytestmark = pytest.mark.engines

CONFIG = LoadConfig(layers=2, token_bytes=32, prompt_max=256, rows=4, device="cpu")
SHAPES = [(200, 0), (137, 16), (64, 0)]  # (prompt, decode prefix) of each round's three requests


@pytest.fixture(scope="module")
def pair():
    yield from _pair(secret=None)


@pytest.fixture(scope="module")
def keyed_pair():
    """The same with a shared secret: the checksums are keyed (kvplan.transport.auth.checksum_key)."""
    yield from _pair(secret=b"the deployment's secret")


def _pair(secret):
    pytest.importorskip("mooncake.engine")
    src, dst = Pools(CONFIG, "cpu", CONFIG.rows), Pools(CONFIG, "cpu", CONFIG.rows)
    # (None: run open, unkeyed checksums; given nothing, the channels would prove the loopback secret)
    channel = ControlChannel(host="127.0.0.1", secret=secret, insecure=secret is None)
    name = uuid.uuid4().hex[:8]
    # Mooncake, not NIXL: NIXL's progress threads each spin a core for as long as their agent lives, which is
    # the rest of this pytest process (on a 2-core machine they starved every later test's sockets)
    decode = DecodeEndpoint(dst.side, make_engine("mooncake", f"decode-{name}", local_hostname="127.0.0.1"), channel,
                            integrity=True)
    prefill = PrefillEndpoint(src.side, make_engine("mooncake", f"prefill-{name}", local_hostname="127.0.0.1"),
                              ControlChannel(channel.port, host="127.0.0.1", secret=secret, insecure=secret is None))
    pair_channels([lambda: decode.register(timeout=10)], [lambda: prefill.accept(timeout=10)])
    yield prefill, decode, src, dst
    for closing in (decode.engine, prefill.engine, channel, prefill.channel):
        closing.close()


def _round(pair, tag: str, checks: bool = True, sends: bool = True, flip: str | None = None,
           deadline_after_send: float | None = None, forge: str | None = None):
    """Publish three requests (checked by the decode or not), send each in up to two chunks (with its
    checksum or not), flip one landed byte of ``flip``'s, wait; the states, the failures and whether
    each request's bytes are the ones written."""
    prefill, decode, src, dst = pair
    decode.integrity, prefill.peers[0].integrity = checks, sends
    arrivals = [Arrival(k, f"{tag}{k}", 0.0, n, p, 0, None) for k, (n, p) in enumerate(SHAPES)]
    rows = {}
    for a in arrivals:
        rows[a.request] = (src.take(a.prompt_len), dst.take(a.prompt_len))
        dst.flush()  # (the row's token-table entries, before the publish reads them)
        d_row = rows[a.request][1][0]
        decode.publish([PreallocatedRequest(a.request, d_row, a.prompt_len, a.prefix_len, aux_index=d_row)],
                       timeout=30)
    prefill.receive_requests(len(arrivals), timeout=10)
    for a in arrivals:  # two chunks where there is room: the sums of chunks add up
        s_row = rows[a.request][0][0]
        src.write(a, s_row, a.prefix_len, a.prompt_len)
        src.aux[s_row] = a.index % 251 + 1
        mid = a.prefix_len + 64 if a.prompt_len - a.prefix_len > 64 else None
        parts = ([(a.prefix_len, mid, False)] if mid else []) + [(mid or a.prefix_len, a.prompt_len + 1, True)]
        for lo, fill, last in parts:
            chunk = Chunk(a.request, s_row, lo, fill, a.prompt_len, last, s_row)
            assert prefill.send([prefill.transfer(chunk)], mode="direct", timeout=30) == {a.request: None}
    if deadline_after_send is not None:  # (the deadline moved close once everything was sent: a busy machine's
        for a in arrivals:               # sends may take longer than a short deadline of their own)
            decode.tracker._status[a.request].deadline = time.monotonic() + deadline_after_send
    if flip is not None:  # every byte has landed (the sends returned); one is flipped before the decode looks
        slot = int(dst.table[rows[flip][1][0], 100])
        dst.kv[1][slot // CONFIG.page_size, slot % CONFIG.page_size, 5] ^= 0x40
    if forge is not None:  # changes the unkeyed sum cannot see: +1, -1, -1, +1 (or its negation) on 4 aligned bytes
        slot = int(dst.table[rows[forge][1][0], 100])
        group = dst.kv[1][slot // CONFIG.page_size, slot % CONFIG.page_size, 4:8]
        assert group.data_ptr() % 4 == 0
        values = [int(v) for v in group]
        step = [1, -1, -1, 1] if values[0] < 255 and values[1] > 0 and values[2] > 0 and values[3] < 255 else [-1, 1, 1, -1]
        assert all(0 <= v + d <= 255 for v, d in zip(values, step)), values
        for k, d in enumerate(step):
            group[k] = values[k] + d
    states = decode.wait()
    checked = {a.request: dst.check(a, rows[a.request][1][0]) for a in arrivals}
    for a in arrivals:
        src.give(*rows[a.request][0])
        dst.give(*rows[a.request][1])
        decode.forget(a.request)
        prefill.forget([a.request])
    return states, dict(decode.failures), checked


def test_checksums_agree_for_bytes_that_landed_whole(pair):
    states, _, checked = _round(pair, "ok")
    assert states == {"ok0": "complete", "ok1": "complete", "ok2": "complete"} and all(checked.values())


def test_a_flipped_byte_fails_its_request_with_the_reason_and_the_others_complete(pair):
    states, failures, _ = _round(pair, "flip", flip="flip1")
    assert states == {"flip0": "complete", "flip1": "failed", "flip2": "complete"}
    assert failures["flip1"].startswith("integrity: the bytes that landed differ from those sent")


def test_without_integrity_the_same_flip_goes_unseen(pair):
    """What the option buys: the same flip, with neither side checking, completes with a wrong byte."""
    states, _, checked = _round(pair, "plain", checks=False, sends=False, flip="plain1")
    assert states["plain1"] == "complete" and not checked["plain1"]


def test_changes_chosen_to_cancel_pass_the_unkeyed_checksum(pair):
    """Without a secret the checksum guards against accidents only. Its hash is public, so bytes
    changed to cancel (+1, -1, -1, +1 on an aligned group of four) pass it: the request completes with
    wrong bytes. (Before the deadline test, whose abort the next round would read.)"""
    states, _, checked = _round(pair, "forged", forge="forged1")
    assert states["forged1"] == "complete" and not checked["forged1"]


def test_a_checksum_that_never_comes_fails_the_request_at_its_deadline(pair):
    states, failures, _ = _round(pair, "late", sends=False, deadline_after_send=0.3)
    assert set(states.values()) == {"failed"}
    assert set(failures.values()) == {"deadline passed before its checksum was checked"}


def test_with_a_secret_the_keyed_checksum_fails_bytes_changed_to_cancel(keyed_pair):
    """The same change under a shared secret: the checksum is keyed per request, and the request fails with
    the reason; the others complete, their keyed sums agreeing on both sides."""
    states, failures, checked = _round(keyed_pair, "keyed", forge="keyed1")
    assert states == {"keyed0": "complete", "keyed1": "failed", "keyed2": "complete"}
    assert failures["keyed1"].startswith("integrity: the bytes that landed differ from those sent")
    assert checked["keyed0"] and checked["keyed2"]
