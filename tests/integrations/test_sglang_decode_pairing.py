"""The SGLang adapter's decode pairs off the scheduler's thread: SGLang's decode calls
``try_ensure_parallel_info``, ``KVReceiver.init``, ``send_metadata`` and ``poll`` on its scheduler
thread, and none of them waits for a bootstrap server or a prefill rank that has not answered. Here the
peer is a socket that takes the connection and holds it without a word until the test lets it go: the
calls return while it holds (it sees no hang-up), the receivers bootstrap meanwhile, and once it closes
every request waiting for it fails with the reason."""

import dataclasses
import select
import socket
import threading

import numpy as np
import pytest

from tests.integrations import sglang_sides
from tests.integrations.sglang_polls import until
from tests.integrations.test_sglang_adapter import _free_managers, _manager  # noqa: F401 (fixture)
from tests.sglang_real import sglang_module

pytestmark = [pytest.mark.sglang, pytest.mark.engines]


class SilentPeer:
    """A listener on loopback that accepts connections, reads what comes and answers nothing until
    :meth:`release` closes them; it records each connection and whether the client hung up first."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.accepted, self.hung_up, self._release = threading.Event(), threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        held = []
        while not self._release.is_set():
            ready, _, _ = select.select([self.sock, *held], [], [], 0.05)
            for s in ready:
                if s is self.sock:
                    conn, _ = self.sock.accept()
                    held.append(conn)
                    self.connections += 1
                    self.accepted.set()
                elif not s.recv(65536):  # the client closed its end
                    held.remove(s)
                    s.close()
                    self.hung_up.set()
        for conn in held:
            conn.close()
        self.sock.close()

    def release(self) -> None:
        self._release.set()
        self.thread.join(5)


def _decode_manager(bootstrap: str):
    base = sglang_module("srt.disaggregation.base.conn")
    kv, aux = sglang_sides.pools(None)
    mgr = _manager(sglang_sides.kv_args_of(base, kv, aux), "DECODE", kvplan_timeout_s=30)
    mgr.settings = dataclasses.replace(mgr.settings, bootstrap=bootstrap)
    return base, mgr


def test_the_prefill_s_layout_is_asked_of_the_bootstrap_server_off_the_scheduler_s_thread():
    peer = SilentPeer()
    base, mgr = _decode_manager("sglang")
    address = f"127.0.0.1:{peer.port}"
    try:
        assert mgr.try_ensure_parallel_info(address) is False  # returned: the lookup runs on a thread of its own
        assert peer.accepted.wait(10)
        assert not peer.hung_up.wait(0.5)  # it still waits for the answer (its bound is 5 s)
        assert mgr.try_ensure_parallel_info(address) is False  # asked again meanwhile: no second lookup
        assert peer.connections == 1
    finally:
        peer.release()
    until(lambda: address not in mgr._layouts or mgr._layouts[address].done())
    assert mgr.try_ensure_parallel_info(address) is False  # the lookup failed: SGLang asks again later
    assert address not in mgr.prefill_info_table


def test_receivers_pair_off_the_scheduler_s_thread_and_fail_with_the_reason_when_the_prefill_cannot():
    peer = SilentPeer()
    base, mgr = _decode_manager("direct")
    from kvplan.integrations.sglang.adapter import KVReceiver  # (SGLang imported first, as the tests do)
  # the bootstrap address is the prefill rank's own listener
    address = f"127.0.0.1:{peer.port}"
    try:
        first = KVReceiver(mgr, address, 1)
        first.init(0)  # returned: the channel's handshake waits on the pairing's thread
        assert peer.accepted.wait(10)
        assert first.poll() == base.KVPoll.Bootstrapping
        assert not peer.hung_up.wait(0.5)
        first.send_metadata(np.array([1, 2], np.int32), aux_index=0)  # kept until its pairing has ended
        assert not first.published
        second = KVReceiver(mgr, address, 2)
        second.init(0)
        assert second.poll() == base.KVPoll.Bootstrapping
        assert peer.connections == 1  # one pairing for both
    finally:
        peer.release()  # closes without a handshake
    until(lambda: first.poll() != base.KVPoll.Bootstrapping)
    assert first.poll() == base.KVPoll.Failed and not first.published
    assert "no prefill rank to pair with at " + address in mgr.failures[1]
    assert second.poll() == base.KVPoll.Failed  # the same failed pairing, not a wait of its own
    assert mgr.failures[2] == mgr.failures[1]
