"""The one wait of the transport's loops (kvplan.transport.runtime.loop): what wakes it, and that it
blocks otherwise."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvplan.transport.runtime.loop import Cadence, Wakeup, engine_fds, wait_ready

zmq = pytest.importorskip("zmq")


def _pair():
    context = zmq.Context.instance()
    a, b = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    port = a.bind_to_random_port("tcp://127.0.0.1")
    b.connect(f"tcp://127.0.0.1:{port}")
    return a, b


class _Channel:
    def __init__(self, sock):
        self.sock, self.closed = sock, False

    def pending(self):
        return False

    def wait_sockets(self):
        return [self.sock]


def test_it_blocks_for_its_timeout_when_nothing_comes():
    wakeup = Wakeup()
    started = time.monotonic()
    assert not wait_ready([], (), 0.05, wakeup)
    assert time.monotonic() - started >= 0.045


def test_a_wake_from_another_thread_ends_it_at_once_and_is_cleared():
    wakeup = Wakeup()
    threading.Timer(0.02, wakeup.wake).start()
    started = time.monotonic()
    assert wait_ready([], (), 5.0, wakeup)
    assert time.monotonic() - started < 1.0
    assert not wait_ready([], (), 0.01, wakeup)  # cleared: the next wait blocks


def test_a_message_on_a_channel_ends_it_and_an_unread_one_keeps_it_awake():
    a, b = _pair()
    try:
        threading.Timer(0.02, lambda: b.send(b"x")).start()
        started = time.monotonic()
        assert wait_ready([_Channel(a)], (), 5.0)
        assert time.monotonic() - started < 1.0
        assert wait_ready([_Channel(a)], (), 5.0)  # (not read yet: ZeroMQ's edge-triggered descriptor is asked first)
        assert a.recv() == b"x"
        assert not wait_ready([_Channel(a)], (), 0.01)
    finally:
        a.close(0)
        b.close(0)


def test_an_engine_descriptor_ends_it():
    r, w = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    engine = type("E", (), {"wait_fds": lambda self: (r.fileno(),)})()
    threading.Timer(0.02, lambda: w.send(b"n")).start()
    started = time.monotonic()
    assert wait_ready([], engine_fds(engine), 5.0)
    assert time.monotonic() - started < 1.0
    assert engine_fds(object()) == ()
    r.close()
    w.close()


def test_a_channel_without_sockets_is_waited_on_for_at_most_a_millisecond():
    class Fake:
        closed = False

        def wait_readable(self, timeout):
            return False

    started = time.monotonic()
    wait_ready([Fake()], (), 1.0)
    assert time.monotonic() - started < 0.5


def test_the_cadence_doubles_to_its_longest_and_starts_over_on_progress():
    cadence = Cadence(first_s=1e-4, longest_s=1e-3)
    assert [cadence.next() for _ in range(6)] == [1e-4, 2e-4, 4e-4, 8e-4, 1e-3, 1e-3]
    cadence.reset()
    assert cadence.next() == 1e-4
