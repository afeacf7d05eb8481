"""A kvplan prefill serving SGLang's own decode: kvplan's prefill manager (``kvplan_protocol="sglang"``)
registers with SGLang's bootstrap server and speaks SGLang's protocol to SGLang's unchanged KV manager
and receiver in another process, over loopback, through Mooncake and through NIXL; and the other way
round, SGLang's own prefill serving a kvplan decode. Three requests (one
chunked, one after a decode prefix), every byte checked on the decode side, the ``KVPoll`` states each
side's caller sees."""


import pytest

from tests.integrations import sglang_sides
from kvplan.tools.target_process import child_context, child_process
from tests.ports import free_port
from tests.sglang_real import sglang_module

pytestmark = [pytest.mark.sglang, pytest.mark.engines]


def _run_pair(state, decode_kv_pages: int = sglang_sides.PAGES, sglang_side: str = "decode",
              backend: str = "mooncake") -> dict:
    """kvplan's side and SGLang's own (``sglang_side``), each joined or killed by its own handle; what
    each reported, by name."""
    results = child_context().Queue()
    port = free_port()
    if sglang_side == "decode":
        procs = [child_process(sglang_sides.run_prefill, backend, port, 11, results, 60.0, state, "sglang", decode_kv_pages),
                 child_process(sglang_sides.run_sglang_decode, port, 11, results, 60.0, state, backend)]
    else:
        procs = [child_process(sglang_sides.run_sglang_prefill, port, 11, results, 60.0, state, backend),
                 child_process(sglang_sides.run_decode, backend, port, 11, results, 60.0, state, None, "decode", "sglang")]
    return sglang_sides.gather(procs, results)


# (backend, state): SGLang's NIXL manager registers state buffers as GPU memory, so over NIXL on the CPU
# the pair moves KV and aux only
CASES = [("mooncake", False), ("mooncake", True), ("mooncake", "hybrid"), ("nixl", False)]


@pytest.mark.parametrize("backend, state", CASES)
def test_a_kvplan_prefill_serves_sglang_s_own_decode(backend, state):
    base = sglang_module("srt.disaggregation.base.conn")
    got = _run_pair(state, backend=backend)
    prefill_states, failures = got["prefill"]
    decode_states, decode_failures, wrong, notes = got["decode"]
    assert not any(failures.values()), failures
    assert notes == 0  # the writes notify nothing: SGLang's decode would hold every notification forever
    assert not decode_failures, decode_failures
    assert not wrong, f"bytes differ on SGLang's decode side: {wrong[:8]}"
    for room, states in decode_states.items():  # SGLang's receiver: Bootstrapping, WaitingForInput, ..., Success
        assert states[:2] == [base.KVPoll.Bootstrapping, base.KVPoll.WaitingForInput], (room, states)
        assert states[-1] == base.KVPoll.Success, (room, states)
    for room, states in prefill_states.items():
        assert states[-1] == base.KVPoll.Success, (room, states)


def test_pages_past_the_decode_s_declared_pools_fail_on_both_sides_and_nothing_lands():
    """SGLang's registration carries no pool sizes: the prefill is told them (``kvplan_decode_lens``) and
    bounds-checks SGLang's destination pages against them. Told a pool of 8 pages, the step whose
    lists reach past it is refused whole (kvplan's strict policy): every request of it fails on both
    sides, the prefill's reason names the page, and no byte lands."""
    base = sglang_module("srt.disaggregation.base.conn")
    got = _run_pair(False, decode_kv_pages=8)
    prefill_states, failures = got["prefill"]
    decode_states, _, wrong, _ = got["decode"]
    lists = sglang_sides.page_lists(11)
    assert any(dst.max() >= 8 for _, dst, _, _ in lists.values()), "the test's lists must reach past 8 pages"
    for room in lists:
        assert prefill_states[room][-1] == base.KVPoll.Failed, prefill_states[room]
        assert "is outside the pool [1, 8)" in failures[room], failures[room]
        assert decode_states[room][-1] == base.KVPoll.Failed, decode_states[room]
    every = {(room, int(p)) for room, (_, dst, _, _) in lists.items() for p in dst} | {(room, "aux") for room in lists}
    assert set(wrong) == every  # every page and aux row of every request still differs: nothing landed


@pytest.mark.parametrize("backend, state", CASES)
def test_sglang_s_own_prefill_serves_a_kvplan_decode(backend, state):
    """The other way round: SGLang's unchanged prefill (``MooncakeKVManager``, ``MooncakeKVSender`` and
    its bootstrap server) writes into a kvplan decode manager (``kvplan_protocol="sglang"``), which
    found it through the bootstrap server, registered its buffers and asked for each request in
    SGLang's messages, and settles each request by SGLang's status message."""
    base = sglang_module("srt.disaggregation.base.conn")
    got = _run_pair(state, sglang_side="prefill", backend=backend)
    prefill_states, prefill_failures = got["prefill"]
    decode_states, wrong = got["decode"]
    assert not prefill_failures, prefill_failures
    assert not wrong, f"bytes differ on kvplan's decode side: {wrong[:8]}"
    for room, states in prefill_states.items():
        assert states[-1] == base.KVPoll.Success, (room, states)
    first = sglang_sides.requests_of(state)[0][0]
    assert decode_states[first][0] == base.KVPoll.Bootstrapping  # before the manager found the prefill
    for room, states in decode_states.items():  # after init: WaitingForInput; asked: Transferring; Success
        assert states[1] == base.KVPoll.WaitingForInput and base.KVPoll.Transferring in states[2:], (room, states)
        assert states[-1] == base.KVPoll.Success, (room, states)


def test_a_kvplan_prefill_spreads_each_request_over_sglang_s_decode_ranks():
    """SGLang's decode at attention TP 2 (two processes, one KV head each) and kvplan's prefill at TP 1
    (both heads): each request is asked for by both decode ranks, planned once for both, and each rank
    receives its head of every token, and the aux row."""
    base = sglang_module("srt.disaggregation.base.conn")
    results = child_context().Queue()
    port = free_port()
    procs = [child_process(sglang_sides.run_prefill, "mooncake", port, 11, results, 60.0, False, "sglang", sglang_sides.PAGES, 2)]
    procs += [child_process(sglang_sides.run_sglang_decode, port, 11, results, 60.0, False, "mooncake", r, 2)
              for r in (0, 1)]
    got = sglang_sides.gather(procs, results)
    prefill_states, failures = got["prefill"]
    assert not any(failures.values()), failures
    assert all(states[-1] == base.KVPoll.Success for states in prefill_states.values()), prefill_states
    for rank in (0, 1):
        decode_states, decode_failures, wrong, notes = got[f"decode-{rank}"]
        assert not decode_failures and not wrong, (rank, decode_failures, wrong[:8])
        assert all(states[-1] == base.KVPoll.Success for states in decode_states.values()), (rank, decode_states)
