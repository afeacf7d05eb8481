"""A batch planned by kvplan moved between two processes by NIXL and by Mooncake, verified byte for byte.

All four state types, aux, chunking and a decode prefix (``hybrid``), head-sliced descriptors
(``head_sliced``), direct and staged mode; then the failure paths: a dead peer, a bad
registration, a deadline. Nothing here may hang: every wait has a deadline.
"""

import os

import pytest
import torch

from tests.transport.handoff import Case, Pair

pytestmark = pytest.mark.engines

ENGINES = os.environ.get("KVPLAN_TEST_ENGINES", "nixl,mooncake").split(",")
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"


def test_nixl_prepared_lists_arrive_byte_for_byte():
    if "nixl" not in ENGINES:
        pytest.skip("NIXL is not among the engines of this run")
    (_, sent), (_, states, failures, verified) = run_case(Case("nixl", "hybrid", "prepared", device=DEVICE))
    assert all(reason is None for reason in sent.values()), sent
    assert set(states.values()) == {"complete"}, failures
    assert verified is True


def run_case(case: Case):
    pair = Pair(case)
    try:
        assert pair.recv(pair.prefill_conn, "prefill")[0] == "ready"
        pair.prefill_conn.send("go")
        sent = pair.recv(pair.prefill_conn, "prefill")
        result = pair.recv(pair.decode_conn, "decode")
        return sent, result
    finally:
        pair.close()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("shape, mode", [("hybrid", "direct"), ("hybrid", "staged"), ("head_sliced", "direct"),
                                         ("head_sliced", "staged")])
def test_batch_arrives_byte_for_byte(engine, shape, mode):
    (_, sent), (_, states, failures, verified) = run_case(Case(engine, shape, mode, device=DEVICE))
    assert all(reason is None for reason in sent.values()), sent
    assert set(states.values()) == {"complete"}, failures
    assert verified is True, "the destination pools differ from the reference execution"


@pytest.mark.parametrize("engine", ENGINES)
def test_dead_decode_peer_fails_every_request_without_hanging(engine):
    pair = Pair(Case(engine, timeout=20, device=DEVICE))
    try:
        assert pair.recv(pair.prefill_conn, "prefill")[0] == "ready"
        pair.kill_decode()
        pair.prefill_conn.send("go")
        kind, sent = pair.recv(pair.prefill_conn, "prefill", timeout=60)
        assert kind == "sent"
        assert sent and all(reason for reason in sent.values()), sent
    finally:
        pair.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_dead_prefill_peer_fails_every_request_at_the_deadline(engine):
    pair = Pair(Case(engine, timeout=3, device=DEVICE), exit_after_accept=True)
    try:
        kind, states, failures, verified = pair.recv(pair.decode_conn, "decode", timeout=60)
        assert set(states.values()) == {"failed"} and verified is None
        assert all("could not be published" in reason or "deadline" in reason for reason in failures.values())
    finally:
        pair.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_requests_that_never_arrive_fail_at_their_deadline(engine):
    pair = Pair(Case(engine, timeout=3, device=DEVICE))
    try:
        assert pair.recv(pair.prefill_conn, "prefill")[0] == "ready"  # the prefill side never sends
        kind, states, failures, verified = pair.recv(pair.decode_conn, "decode", timeout=60)
        assert set(states.values()) == {"failed"} and verified is None
        assert all("deadline passed" in reason for reason in failures.values())
    finally:
        pair.close()


def test_bad_registration_is_refused_on_both_sides():
    pair = Pair(Case(ENGINES[0], bad_registration=True, timeout=20, device=DEVICE))
    try:
        kind, reason = pair.recv(pair.prefill_conn, "prefill")
        assert kind == "refused" and "aux: source has 2 entries, destination 0" in reason
        kind, states, failures, _ = pair.recv(pair.decode_conn, "decode", timeout=60)
        assert set(states.values()) == {"failed"}
        assert all("refused the pairing" in f and "aux" in f for f in failures.values())
    finally:
        pair.close()
