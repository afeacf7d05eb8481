"""The control path survives a restarted sender: a new prefill endpoint that connects to the same
decode channel is registered again and its requests complete; what the old one left has failed."""

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvplan.planner.device.destinations import PreallocatedRequest
from kvplan.planner.contract.batch import Attention, Entry, KVLayout, SideMemory
from kvplan.errors import InputError
from kvplan.transport.control import ControlChannel
from tests.transport.pairing import killed, pair
from kvplan.transport.decode import DecodeEndpoint
from kvplan.transport.prefill import Chunk, PrefillEndpoint
from tests.planner.builders import table_with
from tests.isolated import run_isolated
from tests.transport.fakes import FakeEngine

PAGE, PAGE_BYTES = 4, 256


def side(pool, rows):
    return SideMemory(KVLayout(Attention.MLA, PAGE, (Entry(pool.data_ptr(), PAGE_BYTES, 16),)),
                      req_to_token=table_with(rows, PAGE, max_ctx=16))


def until(predicate, decode, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        decode.poll()
        time.sleep(0.005)


def test_a_restarted_prefill_endpoint_is_registered_again_and_its_requests_complete():
    src_pool, dst_pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8), torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    decode = DecodeEndpoint(side(dst_pool, {1: [3, 4], 2: [6, 7]}), FakeEngine(), ControlChannel(host="127.0.0.1"))
    port = decode.channel.port

    first = PrefillEndpoint(side(src_pool, {1: [5, 9], 2: [10, 11]}), FakeEngine(), ControlChannel(port, host="127.0.0.1"))
    pair([lambda: decode.register(timeout=5)], [lambda: first.accept(timeout=5)])
    decode.publish([PreallocatedRequest("r1", 1, 8)], timeout=5)
    first.receive_requests(1, timeout=5)
    first.channel.close()  # the sender dies before sending anything
    until(lambda: decode.tracker.state("r1") == "failed", decode)
    assert "the prefill side is gone" in decode.tracker.failure("r1")

    second = PrefillEndpoint(side(src_pool, {1: [5, 9], 2: [10, 11]}), FakeEngine(), ControlChannel(port, host="127.0.0.1"))
    with ThreadPoolExecutor(1) as pool:  # the registration, sent again once the decode sees the new sender
        accepted = pool.submit(second.accept, timeout=5)
        until(accepted.done, decode)
        accepted.result()
    decode.publish([PreallocatedRequest("r2", 2, 8)], timeout=5)
    second.receive_requests(1, timeout=5)
    assert second.send([second.transfer(Chunk("r2", 2, 0, 9, 8, True))], mode="direct", timeout=5) == {"r2": None}
    decode.engine.inbox.extend(note for _, note in second.engine.posted)  # the engine's notifications
    states = decode.wait()
    assert states["r2"] == "complete" and states["r1"] == "failed"
    assert np.array_equal(second.engine.posted[0][0][:, 2], [2 * PAGE_BYTES])  # two pages, one run


def test_malformed_control_messages_from_a_peer_are_ignored_not_a_crash():
    # in a child process: in pytest's, after the rest of a full run, its bound channel once never saw its
    # in-process peer connect (as test_warm_up's did twice); the cause is not located
    run_isolated(_malformed_messages, timeout=60)


def _malformed_messages() -> None:
    dst_pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    decode = DecodeEndpoint(side(dst_pool, {1: [3, 4]}), FakeEngine(), ControlChannel(host="127.0.0.1"))
    peer = ControlChannel(decode.channel.port, host="127.0.0.1")
    assert pair([lambda: decode.register(timeout=5)], [lambda: peer.recv(time.monotonic() + 5)])[0][0] == "register"
    decode.publish([PreallocatedRequest("r1", 1, 8)], timeout=5)
    for parts in ([b"failed", b"not json"], [b"failed", b"{}"], [b"failed", b"[1, 2]"], [b"\xff\xfe", b"{}"], [b"x"]):
        peer.socket.send_multipart(parts)
    for _ in range(50):  # half a second: every message arrives and is read
        decode.poll()
        time.sleep(0.01)
    assert decode.tracker.state("r1") == "pending"  # nothing named it: nothing failed


def test_a_stranger_that_connects_to_a_decode_s_channel_and_closes_fails_nothing():
    """One TCP connect and close on a decode's bound channel, no byte sent, failed every pending
    request ("the prefill side is gone: it restarted and connected again"). Now the request waits on and
    completes from its real sender."""
    import socket

    import zmq

    src_pool, dst_pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8), torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    decode = DecodeEndpoint(side(dst_pool, {1: [3, 4]}), FakeEngine(), ControlChannel(host="127.0.0.1"))
    port = decode.channel.port
    prefill = PrefillEndpoint(side(src_pool, {1: [5, 9]}), FakeEngine(), ControlChannel(port, host="127.0.0.1"))
    pair([lambda: decode.register(timeout=5)], [lambda: prefill.accept(timeout=5)])
    decode.publish([PreallocatedRequest("r1", 1, 8)], timeout=5)
    prefill.receive_requests(1, timeout=5)
    socket.create_connection(("127.0.0.1", port)).close()
    stranger = zmq.Context.instance().socket(zmq.PAIR)
    stranger.connect(f"tcp://127.0.0.1:{port}")
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        decode.poll()
        time.sleep(0.01)
    stranger.close(0)
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        decode.poll()
        time.sleep(0.01)
    assert decode.tracker.state("r1") == "pending", decode.tracker.failure("r1")
    assert prefill.send([prefill.transfer(Chunk("r1", 1, 0, 9, 8, True))], mode="direct", timeout=5) == {"r1": None}
    decode.engine.inbox.extend(note for _, note in prefill.engine.posted)
    assert decode.wait()["r1"] == "complete"


def test_a_decode_restarted_on_the_same_port_is_sent_nothing_its_predecessor_published():
    """A decode killed and restarted on its port while its prefill was busy was written the old
    request's bytes into pages of another (Mooncake): the prefill kept the dead one's lists. The new
    process is a new pairing: what the old one published is dropped before the new one registers, and a
    send of it fails naming the request, with nothing posted."""
    src_pool, dst_pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8), torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    old = DecodeEndpoint(side(dst_pool, {1: [3, 4]}), FakeEngine(), ControlChannel(host="127.0.0.1"))
    port = old.channel.port
    prefill = PrefillEndpoint(side(src_pool, {1: [5, 9], 2: [10, 11]}), FakeEngine(), ControlChannel(port, host="127.0.0.1"))
    pair([lambda: old.register(timeout=5)], [lambda: prefill.accept(timeout=5)])
    old.publish([PreallocatedRequest("old", 1, 8)], timeout=5)
    prefill.receive_requests(1, timeout=5)
    killed(old.channel)
    new = DecodeEndpoint(side(dst_pool, {2: [6, 7]}), FakeEngine(), _bound_again(port))
    with ThreadPoolExecutor(1) as pool:
        registered = pool.submit(new.register, timeout=8)
        deadline = time.monotonic() + 8
        while not (registered.done() and prefill.peers[0].side is not None and not prefill.peers[0].dropped
                   and "old" not in prefill.peers[0].lists):
            assert time.monotonic() < deadline, "the prefill never paired with the new decode"
            prefill.progress()
            time.sleep(0.005)
        registered.result()
    try:
        prefill.transfer(Chunk("old", 1, 0, 9, 8, True))
        raise AssertionError("a request of the dead decode was planned for the new one")
    except InputError as err:
        assert "old" in str(err)
    new.publish([PreallocatedRequest("r2", 2, 8)], timeout=5)
    prefill.receive_requests(1, timeout=5)
    assert prefill.send([prefill.transfer(Chunk("r2", 2, 0, 9, 8, True))], mode="direct", timeout=5) == {"r2": None}
    assert [note for _, note in prefill.engine.posted] and all(b"old" not in note for _, note in prefill.engine.posted)


def _bound_again(port):
    """A channel bound on ``port`` once the socket closed there has let it go (ZeroMQ closes it on its own
    thread; a process killed frees it at once)."""
    import zmq

    deadline = time.monotonic() + 5
    while True:
        try:
            return ControlChannel(host="127.0.0.1", bind_port=port)
        except zmq.ZMQError:
            assert time.monotonic() < deadline, f"port {port} was never free again"
            time.sleep(0.01)
