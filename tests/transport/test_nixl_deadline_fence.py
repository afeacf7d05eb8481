"""A deadline's abort is fenced (NIXL over UCX's TCP transport, slow enough to outlast it).

Before, a deadline released the NIXL handle and reported the write ended; UCX cannot cancel a write in
flight and NIXL's release of it succeeds, so most of a large write landed after ``wait_all`` had said it
was over (measured: 748 MB of 1 GiB). Now an in-flight NIXL handle is never released as "aborted": the
wait goes on until NIXL reports it ended (or says ``unsafe`` after ``KVPLAN_DRAIN_S``). The target
snapshots its buffer as soon as ``wait_all`` returns and again a second later: nothing may change.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvplan.tools.target_process import target_process
from tests.transport.one_write import descriptors, engine as _engine, sender

pytestmark = pytest.mark.engines
SIZE = 256 << 20
DEADLINE_S = 60.0


def _target(conn) -> None:
    os.environ["UCX_TLS"] = "tcp,self"  # a transport slow enough that the deadline passes mid-write
    engine = _engine("nixl", "fence-target")
    buf = np.zeros(SIZE, np.uint8)
    engine.register([(buf.ctypes.data, SIZE)])
    conn.send((engine.metadata(), buf.ctypes.data))
    if conn.poll(DEADLINE_S) and conn.recv() == "returned":
        first = buf.copy()
        time.sleep(1.0)
        conn.send(int(np.count_nonzero(buf != first)))
    conn.poll(DEADLINE_S)


def test_a_nixl_write_past_its_deadline_lands_nothing_after_it_is_reported(monkeypatch):
    from kvplan.transport.engines import wait_all

    monkeypatch.setenv("UCX_TLS", "tcp,self")
    monkeypatch.setenv("KVPLAN_DRAIN_S", "30")
    with target_process(_target, start_s=DEADLINE_S) as (conn, hello):
        metadata, remote = hello
        engine, src, peer = sender("nixl", "fence-initiator", metadata, SIZE, 7)
        handle = engine.post(peer, descriptors(src, remote), b"done")
        reason = wait_all(engine, [handle], time.monotonic() + 0.002)[handle]
        conn.send("returned")
        assert conn.poll(DEADLINE_S)
        changed = conn.recv()
        engine.close()
    assert changed == 0, f"{changed} bytes landed after wait_all reported the write over ({reason})"
    assert reason is None or reason.startswith("deadline passed")
