"""kvplan behind SGLang's KVManager, KVSender and KVReceiver: a prefill and a decode process hand
three requests (one chunked, one with a decode prefix) over loopback through NIXL and through
Mooncake, driven through SGLang's interfaces, every byte checked, SGLang's KVPoll states seen."""

import multiprocessing as mp
import os
import random
import socket
import types

import numpy as np
import pytest

from tests.integrations import sglang_sides
from tests.sglang_real import sglang_module

pytestmark = [pytest.mark.sglang, pytest.mark.engines]

ENGINES = os.environ.get("KVPLAN_TEST_ENGINES", "nixl,mooncake").split(",")


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768 and up by default): a port found free in
    that range can be taken by an outgoing connection before the adapter binds it."""
    for port in random.Random().sample(range(20000, 32768), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and 32767")


@pytest.mark.parametrize("engine", ENGINES)
def test_two_processes_hand_off_through_sglang_s_interfaces(engine):
    base = sglang_module("srt.disaggregation.base.conn")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=sglang_sides.run_prefill, args=(engine, port, 11, results, 60.0)),
             ctx.Process(target=sglang_sides.run_decode, args=(engine, port, 11, results, 60.0))]
    for p in procs:
        p.start()
    try:
        got = dict((kind, rest) for kind, *rest in (results.get(timeout=150) for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    prefill_states, failures = got["prefill"]
    decode_states, wrong = got["decode"]
    assert not any(failures.values()), failures
    assert not wrong, f"bytes differ on the decode side: {wrong[:8]}"
    first = sglang_sides.REQUESTS[0][0]
    assert decode_states[first][0] == base.KVPoll.Bootstrapping  # before any receiver connected
    for room, states in decode_states.items():
        # after init: WaitingForInput; after its metadata: Transferring, then Success
        assert states[1] == base.KVPoll.WaitingForInput and base.KVPoll.Transferring in states[2:], (room, states)
        assert states[-1] == base.KVPoll.Success, (room, states)
    for room, states in prefill_states.items():
        assert states[-1] == base.KVPoll.Success, (room, states)
    chunked = [room for room, _, _, chunks in sglang_sides.REQUESTS if chunks == 2][0]
    assert prefill_states[chunked][0] == base.KVPoll.Transferring  # its first chunk went, its last not yet


def test_a_step_that_cannot_be_laid_out_fails_every_send_of_it():
    """More sends in one step than the planning table has rows: nothing is sent, and every sender of
    the step (not only the one that polled) reports Failed with the reason."""
    base = sglang_module("srt.disaggregation.base.conn")
    utils = sglang_module("srt.disaggregation.utils")
    from kvplan.integrations.sglang.adapter import KVManager, KVSender, TransferFailed

    kv, aux = sglang_sides.pools(1)
    server_args = types.SimpleNamespace(disaggregation_transfer_backend="nixl", disaggregation_bootstrap_port=free_port(),
                                        max_running_requests=1, context_length=64)
    mgr = KVManager(sglang_sides.kv_args_of(base, kv, aux), utils.DisaggregationMode.PREFILL, server_args)
    senders = [KVSender(mgr, "127.0.0.1:0", room) for room in (1, 2)]
    for sender in senders:
        sender.init(1, aux_index=0)
        sender.send(np.array([3]))
    assert [s.poll() for s in senders] == [base.KVPoll.Failed, base.KVPoll.Failed]
    assert all("2 sends in one step" in mgr.failures[room] for room in (1, 2))
    with pytest.raises(TransferFailed, match="planning table"):
        senders[1].failure_exception()
