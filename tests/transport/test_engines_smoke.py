"""The engine packages (installed by ``make test``) import and move bytes between two processes over loopback.

One NIXL (UCX, DRAM) and one Mooncake (TCP, P2P handshake) WRITE of scattered descriptors; the
target checks every byte. Every wait has a deadline; children are joined or killed by handle.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvplan.tools.target_process import target_process

pytestmark = pytest.mark.engines
ENGINES = os.environ.get("KVPLAN_TEST_ENGINES", "nixl,mooncake").split(",")

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "65535")
os.environ.setdefault("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", "65535")

SIZE, CHUNK = 1 << 20, 4096
DEADLINE = 30.0


def _pattern() -> np.ndarray:
    return (np.arange(SIZE, dtype=np.uint64) * 2654435761 >> 7).astype(np.uint8)


def _shuffled_offsets(seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Scattered source and destination offsets, so that no engine merges descriptors."""
    n = SIZE // CHUNK
    rng = np.random.default_rng(seed)
    return rng.permutation(n).astype(np.uint64) * CHUNK, rng.permutation(n).astype(np.uint64) * CHUNK


def _expected() -> np.ndarray:
    src, dst = _shuffled_offsets()
    data, out = _pattern(), np.zeros(SIZE, np.uint8)
    for s, d in zip(src.tolist(), dst.tolist()):
        out[d : d + CHUNK] = data[s : s + CHUNK]
    return out


def _nixl():
    from kvplan.transport.engines.nixl import nixl_api as _nixl_api

    return _nixl_api()


def _nixl_target(conn) -> None:
    nixl_agent, nixl_agent_config = _nixl()
    agent = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
    buf = np.zeros(SIZE, np.uint8)
    agent.register_memory(np.array([[buf.ctypes.data, SIZE, 0]], np.uint64), "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline and not agent.check_remote_xfer_done("initiator", b"kv-done"):
        time.sleep(0.001)
    conn.send(bool(np.array_equal(buf, _expected())))
    conn.poll(DEADLINE)


def _mooncake():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return engine


def _mooncake_target(conn) -> None:
    engine = _mooncake()
    buf = np.zeros(SIZE, np.uint8)
    assert engine.register_memory(buf.ctypes.data, SIZE) == 0
    conn.send((engine.get_rpc_port(), buf.ctypes.data))
    if conn.poll(DEADLINE) and conn.recv() == "check":
        conn.send(bool(np.array_equal(buf, _expected())))
    conn.poll(DEADLINE)


def _run_pair(target, initiator) -> None:
    with target_process(target, start_s=DEADLINE) as (conn, hello):
        initiator(conn, hello)


@pytest.mark.skipif("nixl" not in ENGINES, reason="KVPLAN_TEST_ENGINES leaves NIXL out (a GPU run carries one engine)")
def test_nixl_moves_scattered_descriptors_between_two_processes():
    nixl_agent, nixl_agent_config = _nixl()

    def initiator(conn, hello):
        metadata, remote = hello
        agent = nixl_agent("initiator", nixl_agent_config(backends=["UCX"]))
        src = _pattern()
        agent.register_memory(np.array([[src.ctypes.data, SIZE, 0]], np.uint64), "DRAM")
        assert agent.add_remote_agent(metadata) == b"target"
        so, do = _shuffled_offsets()
        lens, zeros = np.full(len(so), CHUNK, np.uint64), np.zeros(len(so), np.uint64)
        local = agent.get_xfer_descs(np.stack([so + np.uint64(src.ctypes.data), lens, zeros], 1), "DRAM")
        remote_descs = agent.get_xfer_descs(np.stack([do + np.uint64(remote), lens, zeros], 1), "DRAM")
        handle = agent.initialize_xfer("WRITE", local, remote_descs, "target", b"kv-done")
        state, deadline = agent.transfer(handle), time.monotonic() + DEADLINE
        while state == "PROC" and time.monotonic() < deadline:
            state = agent.check_xfer_state(handle)
        assert state == "DONE"
        assert conn.poll(DEADLINE) and conn.recv() is True, "the target saw wrong bytes"
        handle.release()

    _run_pair(_nixl_target, initiator)


@pytest.mark.skipif("mooncake" not in ENGINES, reason="KVPLAN_TEST_ENGINES leaves Mooncake out (a GPU run carries one engine)")
def test_mooncake_moves_scattered_descriptors_between_two_processes():
    def initiator(conn, hello):
        port, remote = hello
        engine = _mooncake()
        src = _pattern()
        assert engine.register_memory(src.ctypes.data, SIZE) == 0
        so, do = _shuffled_offsets()
        rc = engine.batch_transfer_sync_write(
            f"127.0.0.1:{port}", (so + np.uint64(src.ctypes.data)).tolist(), (do + np.uint64(remote)).tolist(),
            [CHUNK] * len(so),
        )
        assert rc == 0
        conn.send("check")
        assert conn.poll(DEADLINE) and conn.recv() is True, "the target saw wrong bytes"
        engine.unregister_memory(src.ctypes.data)

    _run_pair(_mooncake_target, initiator)
