"""The same-host ``ipc`` engine on host memory, between two processes: what it writes, what it
refuses before a byte is written, and a hand-off through the endpoints. Its device path (CUDA IPC and
the copy kernel) runs in the GPU suite (``python -m benchmarks ipc``); the translation kernel it
launches is held to its reference in tests/kernels/test_translate.py."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import numpy as np
import pytest

from kvplan.tools.target_process import target_process
from kvplan.transport.engines import TransferError, make_engine, wait_all
from tests.transport.one_write import serve

SIZE = 1 << 20


def _receiver(conn) -> None:
    engine = make_engine("ipc", "receiver")
    buf = np.zeros(SIZE, np.uint8)
    engine.register([(buf.ctypes.data, SIZE // 2)])  # (the second half is not registered)
    conn.send((engine.metadata(), buf.ctypes.data))
    serve(conn, engine, buf.copy, idle_s=30)


def _sender():
    engine = make_engine("ipc", "sender")
    src = np.random.default_rng().integers(0, 256, SIZE, dtype=np.uint8)
    engine.register([(src.ctypes.data, SIZE)])
    return engine, src


def test_a_write_lands_byte_for_byte_and_its_notification_follows():
    with target_process(_receiver) as (conn, (metadata, remote)):
        engine, src = _sender()
        peer = engine.connect(metadata)
        conn.send(("connect", engine.metadata()))  # (the receiver takes the notes of a process it connected to)
        conn.recv()
        pieces = [(0, 4096, 1000), (8192, 100, 5000), (20000, 70000, 40000)]  # (src offset, dst offset, bytes)
        descs = np.array([[src.ctypes.data + s, remote + d, n] for s, d, n in pieces], np.uint64)
        handle = engine.post(peer, descs, b'["r0", 0, "kv", 3]')
        assert wait_all(engine, [handle], time.monotonic() + 10)[handle] is None
        conn.send("notes")
        assert conn.recv() == [("sender", b'["r0", 0, "kv", 3]')]
        conn.send("bytes")
        landed = conn.recv()
        want = np.zeros(SIZE, np.uint8)
        for s, d, n in pieces:
            want[d : d + n] = src[s : s + n]
        np.testing.assert_array_equal(landed, want)
        engine.close()


def test_a_descriptor_outside_the_registered_regions_writes_nothing_and_fails_its_section():
    with target_process(_receiver) as (conn, (metadata, remote)):
        engine, src = _sender()
        peer = engine.connect(metadata)
        conn.send(("connect", engine.metadata()))  # (the receiver takes the notes of a process it connected to)
        conn.recv()
        inside = [src.ctypes.data, remote, 64]
        straddling = [src.ctypes.data, remote + SIZE // 2 - 32, 64]  # runs past the registered half
        handles = engine.post_device(peer, np.array([inside, straddling, inside], np.uint64), [b"a", b"b"],
                                     [(0, 1), (1, 3)])
        outcome = wait_all(engine, handles, time.monotonic() + 10)
        assert outcome[handles[0]] is None
        assert "1 descriptors lie outside the regions" in outcome[handles[1]], outcome
        conn.send("notes")
        assert conn.recv() == [("sender", b"a")]  # (the failed section's note never goes)
        conn.send("bytes")
        landed = conn.recv()
        assert not landed[SIZE // 2 - 32 : SIZE // 2 + 32].any()
        np.testing.assert_array_equal(landed[:64], src[:64])
        engine.close()


def test_a_peer_on_another_host_or_of_another_memory_is_refused_at_connect():
    receiver = make_engine("ipc", "receiver")
    buf = np.zeros(64, np.uint8)
    receiver.register([(buf.ctypes.data, 64)])
    sender, _ = _sender()
    meta = json.loads(receiver.metadata())
    with pytest.raises(TransferError, match="another host"):
        sender.connect(json.dumps({**meta, "boot_id": "0" * 32}).encode())
    with pytest.raises(TransferError, match="VRAM to VRAM or DRAM to DRAM"):
        sender.connect(json.dumps({**meta, "memory": "VRAM"}).encode())
    with pytest.raises(TransferError, match="not ipc"):
        sender.connect(json.dumps({**meta, "engine": "nixl"}).encode())
    with pytest.raises(TransferError, match="malformed"):
        sender.connect(b'{"engine": "ipc"}')
    peer = sender.connect(receiver.metadata())  # (the same process: its own memory, its own socket)
    receiver.close()
    handle = sender.post(peer, np.array([[buf.ctypes.data, buf.ctypes.data, 8]], np.uint64), b"note")
    reason = wait_all(sender, [handle], time.monotonic() + 10)[handle]
    assert reason is not None and "cannot be reached" in reason, reason  # its socket is gone
    sender.close()


def test_a_hand_off_through_the_endpoints_arrives_byte_for_byte_with_a_secret(monkeypatch):
    """The demo's two processes over ``ipc`` (host memory here), every state kind, with the secret: the
    engine's notifications are sealed like any engine's."""
    from kvplan.tools.demo import run_demo
    from tests.transport.test_handoff import config

    monkeypatch.setenv("KVPLAN_SECRET", "the deployment's secret")
    monkeypatch.delenv("KVPLAN_SECRET_FILE", raising=False)
    report = run_demo(replace(config("ipc", "hybrid", "direct"), timeout=60))
    assert set(report.states.values()) == {"complete"}, report.failures
    assert report.verified is True and report.ok


def test_a_send_after_the_first_is_launched_behind_its_plan_and_arrives_byte_for_byte():
    """Once a send has shaped the copy, the next is launched before the host reads its plan (the plan's
    row count read where the copy runs) and its sections attach after: every batch still lands whole."""
    from kvplan.tools.demo import run_demo
    from tests.transport.test_handoff import config

    report = run_demo(replace(config("ipc", "hybrid", "direct"), repeat=3, timeout=60))
    assert set(report.states.values()) == {"complete"}, report.failures
    assert report.verified is True and report.ok
    assert "launched behind their plans" in report.mode_used, report.mode_used
