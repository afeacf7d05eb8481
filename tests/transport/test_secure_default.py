"""Secure by default (kvplan/transport/auth.py channel_secret, loopback_secret): on loopback, channels given
no secret prove this user's loopback secret, made private by the first process that needs it; off loopback
they do not start without one; only the explicit opt-out runs them open, logged and counted."""

import logging
import multiprocessing
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvplan.errors import SettingError
from kvplan.transport import auth
from kvplan.transport.control import ControlChannel
from kvplan.transport.control_wire import SecretMismatch
from kvplan.transport.listener import ChannelListener, channel_via
from tests.transport.test_control import _first

OFF_LOOPBACK = "192.0.2.1"  # (TEST-NET-1: never this machine's, never routed)


@pytest.fixture
def nothing_configured(monkeypatch, tmp_path):
    """No secret in the environment, no opt-out, and a loopback secret of this test's own (not yet made)."""
    for name in ("KVPLAN_SECRET", "KVPLAN_SECRET_FILE", "KVPLAN_INSECURE"):
        monkeypatch.delenv(name, raising=False)
    folder = tmp_path / "private"
    path = folder / "loopback-secret"
    monkeypatch.setenv("KVPLAN_LOOPBACK_SECRET_FILE", str(path))
    return path


def _refused(bound, stranger):
    """``stranger``'s first message never leaves (it learns the mismatch from the hello or proof of ``bound``,
    whose owner reads meanwhile) and ``bound`` takes nothing and pairs with no one."""
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(stranger.send, "lists", {"n": 1}, timeout=5)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            assert bound.try_recv() is None
            time.sleep(0.01)
        with pytest.raises(SecretMismatch):
            sent.result(timeout=5)
    assert bound.peer_incarnation is None and stranger.peer_incarnation is None


def test_two_channels_given_no_secret_on_loopback_pair_under_the_loopback_secret(nothing_configured):
    bound = ControlChannel(host="127.0.0.1", peer_timeout=30)
    peer = ControlChannel(bound.port, host="127.0.0.1", peer_timeout=30)
    try:
        assert _first(peer, bound, "lists", {"n": 1})[:2] == ("lists", {"n": 1})
        assert bound.secret == peer.secret == nothing_configured.read_bytes().strip()
        assert len(bound.secret) == 64  # (32 random bytes, hex)
        assert stat.S_IMODE(nothing_configured.stat().st_mode) == 0o600
        assert stat.S_IMODE(nothing_configured.parent.stat().st_mode) == 0o700
    finally:
        bound.close()
        peer.close()


def test_a_process_without_the_loopback_secret_cannot_pair_on_loopback(nothing_configured):
    """What another user's process is: it cannot read the file, so it holds some other secret, or runs open."""
    bound = ControlChannel(host="127.0.0.1", peer_timeout=30)
    stranger = ControlChannel(bound.port, host="127.0.0.1", secret=b"not-the-loopback-one", peer_timeout=30)
    try:
        _refused(bound, stranger)
    finally:
        bound.close()
        stranger.close()


def test_a_stranger_running_open_gets_nothing_from_a_channel_on_the_loopback_secret(nothing_configured):
    bound = ControlChannel(host="127.0.0.1", peer_timeout=30)
    stranger = ControlChannel(bound.port, host="127.0.0.1", insecure=True, peer_timeout=30)
    try:
        assert stranger.secret is None
        _refused(bound, stranger)
    finally:
        bound.close()
        stranger.close()


@pytest.mark.parametrize("make", [
    lambda: ControlChannel(host=OFF_LOOPBACK),
    lambda: ControlChannel(17000, host=OFF_LOOPBACK),
    lambda: ChannelListener(0, host=OFF_LOOPBACK),
    lambda: channel_via(OFF_LOOPBACK, 17000, timeout=0.1),
], ids=["bound", "connecting", "listener", "channel_via"])
def test_off_loopback_nothing_starts_without_a_secret_and_the_error_says_what_to_set(nothing_configured, make):
    with pytest.raises(SettingError) as raised:
        make()
    message = str(raised.value)
    assert OFF_LOOPBACK in message and "KVPLAN_SECRET_FILE" in message and "KVPLAN_INSECURE=1" in message
    assert not nothing_configured.exists()  # (no loopback secret is made for a host that is not loopback)


def test_off_loopback_a_configured_secret_is_enough(nothing_configured, monkeypatch):
    monkeypatch.setenv("KVPLAN_SECRET", "from-the-deployment")
    channel = ControlChannel(17000, host=OFF_LOOPBACK)
    try:
        assert channel.secret == b"from-the-deployment"
    finally:
        channel.close()


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_the_explicit_opt_out_runs_open_logged_and_counted(nothing_configured, monkeypatch, caplog, how):
    """KVPLAN_INSECURE (or an integration's insecure setting, passed as ``insecure``) is the only way to run
    without a secret; a process's open channels are logged once a host and counted in its metrics."""
    if how == "environment":
        monkeypatch.setenv("KVPLAN_INSECURE", "1")
    host = f"192.0.2.{2 if how == 'argument' else 3}"  # (a host not yet logged in this process)
    before = auth.open_channels()
    with caplog.at_level(logging.WARNING, logger="kvplan.transport.auth"):
        channels = [ControlChannel(17000, host=host, insecure=how == "argument") for _ in range(2)]
    try:
        assert all(channel.secret is None for channel in channels)
        assert auth.open_channels() == before + 2
        warnings = [r for r in caplog.records if "run open" in r.getMessage() and host in r.getMessage()]
        assert len(warnings) == 1
        pytest.importorskip("prometheus_client")
        from kvplan.transport.metrics import render

        assert f"kvplan_open_channels_total {float(before + 2)}" in render(lambda: [])
    finally:
        for channel in channels:
            channel.close()


def test_a_configured_secret_wins_over_the_opt_out(nothing_configured, monkeypatch):
    monkeypatch.setenv("KVPLAN_SECRET", "from-the-deployment")
    assert auth.channel_secret(OFF_LOOPBACK, insecure=True) == b"from-the-deployment"
    assert auth.channel_secret("127.0.0.1", insecure=True) == b"from-the-deployment"


def test_the_opt_out_is_a_switch_and_anything_else_is_refused(nothing_configured, monkeypatch):
    monkeypatch.setenv("KVPLAN_INSECURE", "perhaps")
    with pytest.raises(SettingError, match="KVPLAN_INSECURE"):
        auth.channel_secret(OFF_LOOPBACK)


def test_a_loopback_secret_that_others_may_read_is_refused(nothing_configured):
    nothing_configured.parent.mkdir(mode=0o700)
    nothing_configured.write_text("a" * 64)
    os.chmod(nothing_configured, 0o644)
    with pytest.raises(SettingError, match="chmod 600"):
        auth.loopback_secret()


def test_a_loopback_secret_in_a_folder_others_may_write_is_refused(nothing_configured):
    nothing_configured.parent.mkdir(mode=0o700)
    os.chmod(nothing_configured.parent, 0o777)
    with pytest.raises(SettingError, match="not this user's alone"):
        auth.loopback_secret()
    assert not nothing_configured.exists()


def test_an_existing_loopback_secret_is_read_not_replaced(nothing_configured):
    nothing_configured.parent.mkdir(mode=0o700)
    nothing_configured.write_text("made-by-an-earlier-process\n")
    os.chmod(nothing_configured, 0o600)
    assert auth.loopback_secret() == b"made-by-an-earlier-process"


def _read_secret(path, barrier, out):
    barrier.wait(30)  # (every process creates it at once)
    out.put(auth.loopback_secret(str(path)))


def test_processes_that_create_the_loopback_secret_at_once_end_with_one_secret(nothing_configured):
    """Each writes its own draft and links it in: the first link wins and every process reads that one."""
    nothing_configured.parent.mkdir(mode=0o700)
    context = multiprocessing.get_context("fork")
    out, barrier = context.Queue(), context.Barrier(8)
    children = [context.Process(target=_read_secret, args=(nothing_configured, barrier, out)) for _ in range(8)]
    for child in children:
        child.start()
    try:
        secrets = {out.get(timeout=30) for _ in children}
    finally:
        for child in children:
            child.join(10)
            if child.is_alive():
                child.kill()
                child.join()
    assert secrets == {nothing_configured.read_bytes().strip()}
    assert sorted(os.listdir(nothing_configured.parent)) == ["loopback-secret"]  # (no draft left behind)
