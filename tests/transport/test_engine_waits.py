"""Waiting for engine writes: every handle ends before it is reported, and a deadline aborts first."""

import time

import numpy as np
import pytest

from kvplan.transport.engines import TransferError, engine_names, make_engine, wait_all, write
from tests.transport.fakes import FakeEngine

DESC = np.array([[0x1000, 0x2000, 64]], np.uint64)


def test_handles_that_finish_are_reported_done():
    engine = FakeEngine(steps=3)
    handles = [engine.post("peer", DESC, b"n") for _ in range(4)]
    outcome = wait_all(engine, handles, time.monotonic() + 5)
    assert list(outcome.values()) == [None] * 4


def test_a_deadline_aborts_and_reports_only_once_the_write_has_ended(monkeypatch):
    monkeypatch.setenv("KVPLAN_DRAIN_S", "5")
    engine = FakeEngine(stuck=True, abort_after=3)  # the engine refuses to cancel three times
    handle = engine.post("peer", DESC, b"n")
    reason = wait_all(engine, [handle], time.monotonic() + 0.05)[handle]
    assert engine.aborts == 4 and handle.state == "ERR"
    assert reason.startswith("deadline passed; the write had ended")


def test_a_write_that_cannot_be_ended_is_reported_unsafe(monkeypatch):
    monkeypatch.setenv("KVPLAN_DRAIN_S", "0.05")
    engine = FakeEngine(stuck=True, abort_after=None)
    handle = engine.post("peer", DESC, b"n")
    reason = wait_all(engine, [handle], time.monotonic() + 0.01)[handle]
    assert reason.startswith("unsafe") and engine.aborts > 1


def test_stuck_writes_drain_together_not_one_after_another(monkeypatch):
    """Eight stuck writes drained one after another, 40.5 s against a bound of 5.5 s (each got its
    own drain after the one before had ended). They now drain together: every one is asked to end in the
    first turn after the deadline, and each is reported unsafe after one drain (the order of the engine's
    abort calls shows it, not a clock)."""
    monkeypatch.setenv("KVPLAN_DRAIN_S", "0.2")
    engine = FakeEngine(stuck=True, abort_after=None)
    asked = []
    abort = engine.abort
    engine.abort = lambda handle: asked.append(handle) or abort(handle)
    handles = [engine.post("peer", DESC, b"n") for _ in range(8)]
    outcome = wait_all(engine, handles, time.monotonic() + 0.01)
    assert all(reason.startswith("unsafe: deadline passed") for reason in outcome.values()), outcome
    assert asked[:8] == handles, "the stuck writes were not all asked to end at once"


def test_write_raises_with_the_reason():
    engine = FakeEngine(stuck=True, abort_after=0)
    with pytest.raises(TransferError, match="deadline passed"):
        write(engine, "peer", DESC, b"n", time.monotonic() + 0.01)


def test_the_registry_names_every_engine_and_refuses_others():
    assert engine_names() == ["ipc", "mooncake", "nixl"]
    with pytest.raises(ValueError, match="choose from ipc, mooncake, nixl"):
        make_engine("rdma-magic", "x")


def test_mooncake_settings_asked_win_then_the_environment_then_the_defaults(monkeypatch):
    from kvplan.transport.engines.mooncake import TCP_DEFAULTS, apply_tcp_settings

    for var in TCP_DEFAULTS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MC_NUM_TCP_IO_THREADS", "3")  # the operator's own setting stays
    settings = apply_tcp_settings(lanes=5, io_threads=None, slice_bytes=None)
    assert settings["MC_TCP_LANES_PER_PEER"] == "5"
    assert settings["MC_NUM_TCP_IO_THREADS"] == "3"
    assert settings["MC_TCP_SLICE_SIZE"] == str(TCP_DEFAULTS["MC_TCP_SLICE_SIZE"])
    assert settings["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] == "65535"
    with pytest.raises(ValueError, match="lanes must be positive"):
        apply_tcp_settings(lanes=0)
    with pytest.raises(ValueError, match="unknown Mooncake setting 'threads'"):
        apply_tcp_settings(threads=2)


def test_a_write_to_a_dead_peer_is_given_up_while_the_others_complete():
    """A batch that fans out to two decode endpoints gave up every write when one
    of them died; the live one's requests failed with it."""
    engine = FakeEngine(steps=50)
    dead, alive = engine.post("dead", [[0, 0, 64]], b""), engine.post("alive", [[0, 0, 64]], b"")
    outcome = wait_all(engine, [dead, alive], time.monotonic() + 5,
                       give_up=lambda h: "the decode side is gone" if h.peer == "dead" else None)
    assert outcome[alive] is None
    assert outcome[dead].startswith("the decode side is gone; the write had ended")
