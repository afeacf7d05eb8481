"""kvplan behind SGLang's KVManager, KVSender and KVReceiver: a prefill and a decode process hand
three requests (one chunked, one with a decode prefix) over loopback through NIXL and through
Mooncake, driven through SGLang's interfaces, every byte checked, SGLang's KVPoll states seen."""

import gc
import os
import types

import numpy as np
import pytest

from kvplan.tools.target_process import child_context, child_process
from tests.ports import free_port  # noqa: F401 (other test modules import it from here)
from tests.integrations import sglang_sides
from tests.integrations.sglang_polls import concluded
from tests.sglang_real import sglang_module

pytestmark = [pytest.mark.sglang, pytest.mark.engines]

ENGINES = os.environ.get("KVPLAN_TEST_ENGINES", "nixl,mooncake").split(",")


_MADE: list = []  # the managers this process's tests made, closed after each test


@pytest.fixture(autouse=True)
def _free_managers():
    """Close each test's managers at once: an engine left to a later garbage collection keeps its
    progress thread spinning, and on a 2-core machine those threads starve later tests."""
    yield
    while _MADE:
        _MADE.pop().close()
    gc.collect()


def _manager(args, mode: str, **settings):
    """An in-process NIXL manager, without NIXL's spinning progress thread, closed after the test."""
    utils = sglang_module("srt.disaggregation.utils")
    from kvplan.integrations.sglang.adapter import KVManager

    # kvplan's listener on the bootstrap port itself (no SGLang bootstrap server here), on loopback
    server_args = types.SimpleNamespace(disaggregation_transfer_backend="nixl", disaggregation_bootstrap_port=free_port(),
                                        kvplan_engine_settings={"progress_thread": False}, kvplan_bootstrap="direct",
                                        kvplan_host="127.0.0.1", host="127.0.0.1", **settings)
    mgr = KVManager(args, getattr(utils.DisaggregationMode, mode), server_args)
    _MADE.append(mgr)
    return mgr




def _run_sides(engine: str, state, decodes: list[tuple]) -> dict:
    """One prefill process and a decode process per entry of ``decodes`` (the extra arguments of
    ``run_decode``: its rooms and its name), each joined or killed by its own handle; what each
    reported, by name."""
    results = child_context().Queue()
    port = free_port()
    procs = [child_process(sglang_sides.run_prefill, engine, port, 11, results, 60.0, state)]
    procs += [child_process(sglang_sides.run_decode, engine, port, 11, results, 60.0, state, *extra)
              for extra in decodes]
    return sglang_sides.gather(procs, results)


@pytest.mark.parametrize("engine, state", [(e, s) for s in (False, True, "hybrid") for e in ENGINES])
def test_two_processes_hand_off_through_sglang_s_interfaces(engine, state):
    """With ``state``, both sides also register a Mamba component (SGLang's multi-component
    ``KVArgs``), and each request's slots come with its last chunk and its metadata. ``"hybrid"``
    registers an SWA and a DSA component instead, and hands SGLang's precomputed lists (the window's
    translated SWA pages, the indexer's pages) with true token counts that end inside a page; two of
    its requests come after a decode prefix, where SGLang's SWA and DSA lists start at the prefix."""
    base = sglang_module("srt.disaggregation.base.conn")
    got = _run_sides(engine, state, [()])
    prefill_states, failures = got["prefill"]
    decode_states, wrong = got["decode"]
    assert not any(failures.values()), failures
    assert not wrong, f"bytes differ on the decode side: {wrong[:8]}"
    first = sglang_sides.requests_of(state)[0][0]
    assert decode_states[first][0] == base.KVPoll.Bootstrapping  # before any receiver connected
    for room, states in decode_states.items():
        # after init: WaitingForInput; after its metadata: Transferring, then Success
        assert states[1] == base.KVPoll.WaitingForInput and base.KVPoll.Transferring in states[2:], (room, states)
        assert states[-1] == base.KVPoll.Success, (room, states)
    for room, states in prefill_states.items():
        assert states[-1] == base.KVPoll.Success, (room, states)
    chunked = [room for room, _, _, chunks in sglang_sides.requests_of(state) if chunks == 2][0]
    assert prefill_states[chunked][0] == base.KVPoll.Transferring  # its first chunk went, its last not yet


def test_a_decode_that_asks_for_checksums_completes_each_request_once_its_bytes_agree():
    """Integrity is a setting (``kvplan_integrity``, ``KVPLAN_INTEGRITY``). The decode asks its
    prefill for each request's checksum and completes a request only once its own sum over what landed
    agrees (a sum that never came would fail it at its deadline): every request succeeds, every byte right."""
    base = sglang_module("srt.disaggregation.base.conn")
    got = _run_sides(ENGINES[0], False, [(None, "decode", "kvplan", True)])
    prefill_states, failures = got["prefill"]
    decode_states, wrong = got["decode"]
    assert not any(failures.values()) and not wrong, (failures, wrong[:8])
    assert all(states[-1] == base.KVPoll.Success for states in decode_states.values()), decode_states


def test_on_one_host_the_ipc_engine_moves_every_byte_and_lists_handed_while_pairing_are_kept():
    """``KVPLAN_ENGINE=ipc`` under SGLang's ``nixl`` backend: the prefill writes the decode's pools itself
    (here host memory, written by ``process_vm_writev``; on a GPU through CUDA IPC), KV, aux and every
    hybrid state kind. The decode pairs with its prefill off the scheduler's thread, and hands each
    request's lists right after ``init`` (its pairing still under way): they are kept and published at a
    later ``poll``. Every request succeeds on both sides, every byte right."""
    base = sglang_module("srt.disaggregation.base.conn")
    got = _run_sides("ipc", "hybrid", [(None, "decode", "kvplan", False, 0, True)])
    prefill_states, failures = got["prefill"]
    decode_states, wrong = got["decode"]
    assert not any(failures.values()) and not wrong, (failures, wrong[:8])
    assert all(states[-1] == base.KVPoll.Success for states in decode_states.values()), decode_states
    assert all(states[-1] == base.KVPoll.Success for states in prefill_states.values()), prefill_states


def test_with_a_staging_buffer_every_request_moves_staged_byte_for_byte():
    """``staging_mib`` gives both managers a buffer when they are made; mode ``staged`` then moves each step
    through it (the prefill's last batch went staged), KV, aux and every hybrid state kind right."""
    base = sglang_module("srt.disaggregation.base.conn")
    results = child_context().Queue()
    port = free_port()
    procs = [child_process(sglang_sides.run_prefill, ENGINES[0], port, 11, results, 90.0, "hybrid", "kvplan",
                                 sglang_sides.PAGES, 1, 8),
             child_process(sglang_sides.run_decode, ENGINES[0], port, 11, results, 90.0, "hybrid", None, "decode",
                           "kvplan", False, 8)]
    got = sglang_sides.gather(procs, results)
    prefill_states, failures, mode = got["prefill"]
    decode_states, wrong = got["decode"]
    assert not any(failures.values()) and not wrong, (failures, wrong[:8])
    assert mode == "staged"
    assert all(states[-1] == base.KVPoll.Success for states in decode_states.values()), decode_states


@pytest.mark.parametrize("mode", ["PREFILL", "DECODE"])
def test_off_loopback_a_manager_without_a_secret_does_not_start_and_says_what_to_set(mode, monkeypatch):
    """Secure by default (docs/failures.md §10): a manager whose host is not loopback stops at start, before its
    engine or any socket, unless a secret is configured or ``insecure`` opts out."""
    base = sglang_module("srt.disaggregation.base.conn")
    utils = sglang_module("srt.disaggregation.utils")
    from kvplan.errors import SettingError
    from kvplan.integrations.sglang.adapter import KVManager

    for name in ("KVPLAN_SECRET", "KVPLAN_SECRET_FILE", "KVPLAN_INSECURE"):
        monkeypatch.delenv(name, raising=False)
    server_args = types.SimpleNamespace(disaggregation_transfer_backend="nixl", disaggregation_bootstrap_port=free_port(),
                                        kvplan_engine_settings={"progress_thread": False}, kvplan_bootstrap="direct",
                                        kvplan_host="192.0.2.1", host="127.0.0.1", max_running_requests=1,
                                        context_length=64)
    with pytest.raises(SettingError, match=r"192\.0\.2\.1 \(not loopback\) has no shared secret.*KVPLAN_INSECURE=1"):
        KVManager(sglang_sides.kv_args_of(base, *sglang_sides.pools(1)), getattr(utils.DisaggregationMode, mode),
                  server_args)


def test_a_step_that_cannot_be_laid_out_fails_every_send_of_it():
    """More sends in one step than the planning table has rows: nothing is sent, and every sender of
    the step (not only the one that polled) reports Failed with the reason."""
    base = sglang_module("srt.disaggregation.base.conn")
    from kvplan.integrations.sglang.adapter import KVSender, TransferFailed

    kv, aux = sglang_sides.pools(1)
    mgr = _manager(sglang_sides.kv_args_of(base, kv, aux), "PREFILL", max_running_requests=1, context_length=64)
    senders = [KVSender(mgr, "127.0.0.1:0", room) for room in (1, 2)]
    for sender in senders:
        sender.init(1, aux_index=0)
        sender.send(np.array([3]))
    assert [s.poll() for s in senders] == [base.KVPoll.Failed, base.KVPoll.Failed]
    assert all("2 sends in one step" in mgr.failures[room] for room in (1, 2))
    with pytest.raises(TransferFailed, match="planning table"):
        senders[1].failure_exception()


def _state_manager(mode: str):
    """A manager whose ``KVArgs`` register KV, aux and a Mamba component (SGLang's multi-component form)."""
    base = sglang_module("srt.disaggregation.base.conn")
    kv, aux = sglang_sides.pools(1)
    mamba = sglang_sides.mamba_pool(1)
    args = sglang_sides.with_mamba(sglang_sides.kv_args_of(base, kv, aux), mamba)
    mgr = _manager(args, mode, max_running_requests=4, context_length=64)
    if mode == "PREFILL":
        _add_decode(mgr)
    return base, mgr, (kv, aux, mamba)


def _add_decode(mgr):
    """A decode manager's place on the prefill manager, as its channel's registration would make it
    (an in-memory channel: what the prefill reports goes nowhere)."""
    from kvplan.transport.prefill import Peer
    from tests.transport.fakes import FakeChannel

    mgr.prefill.peers.append(Peer(FakeChannel.pair()[0]))


def test_a_last_chunk_without_its_state_slot_fails_and_nothing_is_sent():
    """Without the slot, the planner would read whatever slot its map row held: another request's state."""
    base, mgr, _ = _state_manager("PREFILL")  # (skips where SGLang is not installed)
    from kvplan.integrations.sglang.adapter import KVSender
    from kvplan.planner.contract.plan import DestinationLists

    for room in (5, 6):  # as if the decode side had published them
        mgr.prefill.peers[0].lists[room] = (DestinationLists(np.array([3]), (np.array([1]),)), 0, 0)
    sender = KVSender(mgr, "127.0.0.1:0", 5)
    sender.init(1, aux_index=0)
    sender.send(np.array([3]))  # the last chunk, no state_indices
    assert concluded(sender, base.KVPoll) == base.KVPoll.Failed
    assert "needs one state list per component ['mamba']" in mgr.failures[5]
    two = KVSender(mgr, "127.0.0.1:0", 6)
    two.init(1, aux_index=0)
    two.send(np.array([4]), state_indices=[[1, 2]])
    assert concluded(two, base.KVPoll) == base.KVPoll.Failed and "one slot per request, got 2 ids" in mgr.failures[6]


@pytest.mark.parametrize("engine", ENGINES)
def test_one_prefill_manager_serves_two_decode_managers(engine):
    """Each decode manager asks the prefill's bootstrap port for a channel of its own; one step's
    sends go to the decode managers that published them, planned as one batch (with state: the
    hybrid SWA, DSA and ring components), every byte checked on both decode sides."""
    base = sglang_module("srt.disaggregation.base.conn")
    got = _run_sides(engine, "hybrid", [((100, 102), "decode-a"), ((101,), "decode-b")])
    prefill_states, failures = got["prefill"]
    assert not any(failures.values()), failures
    assert all(states[-1] == base.KVPoll.Success for states in prefill_states.values()), prefill_states
    for name, rooms in (("decode-a", {100, 102}), ("decode-b", {101})):
        decode_states, wrong = got[name]
        assert set(decode_states) == rooms and not wrong, (name, wrong[:8])
        assert all(states[-1] == base.KVPoll.Success for states in decode_states.values()), (name, decode_states)


def test_a_window_left_out_is_refused_naming_the_server_arg():
    base = sglang_module("srt.disaggregation.base.conn")
    utils = sglang_module("srt.disaggregation.utils")
    from kvplan.errors import LayoutError
    from kvplan.integrations.sglang.adapter import KVManager

    kv, aux = sglang_sides.pools(1)
    args = sglang_sides.kv_args_of(base, kv, aux)
    args.state_types, args.state_data_ptrs = ["swa"], [[kv[0].data_ptr()]]
    args.state_data_lens, args.state_item_lens = [[kv[0].numel()]], [[64]]
    with pytest.raises(LayoutError, match="window >= 1 is required.*kvplan_state_params"):
        KVManager(args, utils.DisaggregationMode.DECODE, types.SimpleNamespace())
    paged_apart = types.SimpleNamespace(kvplan_state_params=[{"window": 8, "page_size": 2 * sglang_sides.PAGE}])
    with pytest.raises(LayoutError, match="maps SWA pages paged like the KV only"):
        KVManager(args, utils.DisaggregationMode.DECODE, paged_apart)


def _hybrid_sender(room: int, pages: list[int], prefix: int = 0, state_params=sglang_sides.STATE_PARAMS):
    """A prefill manager with SWA, DSA and ring components, and a sender whose decode lists are in."""
    base = sglang_module("srt.disaggregation.base.conn")
    from kvplan.integrations.sglang.adapter import KVSender
    from kvplan.integrations.sglang.kv_args import side_from_kv_args
    from kvplan.planner.contract.plan import DestinationLists

    kv, aux = sglang_sides.pools(1)
    args, _ = sglang_sides.with_state(sglang_sides.kv_args_of(base, kv, aux), "hybrid", 1)
    mgr = _manager(args, "PREFILL", max_running_requests=4, context_length=64, kvplan_state_params=state_params)
    _add_decode(mgr)
    decode_args, _ = sglang_sides.with_state(sglang_sides.kv_args_of(base, *sglang_sides.pools(None)), "hybrid", None)
    mgr.prefill.peers[0].side = side_from_kv_args(decode_args, mla=False, state_params=mgr.state_params)
    dst = np.arange(10, 10 + len(pages))
    ring = np.arange(16, 22)  # six rows of the decode's request-pool row 1
    for r in (room, room + 1):
        mgr.prefill.peers[0].lists[r] = (DestinationLists(dst, (np.array([3, 4]), dst, ring)), 0, prefix)
    posted = mgr.posted = []
    mgr.engine.post = lambda *a, **k: posted.append(a)  # what would reach the engine (no cycle through mgr)
    sender = KVSender(mgr, "127.0.0.1:0", room)
    sender.init(len(pages), aux_index=0)
    return base, mgr, sender


RING = [36, 37, 38, 39, 40, 41]  # positions 4..9 of request-pool row 2 (R = 16, W = 6)


@pytest.mark.parametrize("swa, dsa, ring, why", [
    ([5, 6, 2], [7, 9, 8], RING, "SGLang's dsa list [7, 9, 8]... is not the request's pages [7, 8, 9]"),
    ([5, 6, 2, 1], [7, 8, 9], RING, "4 window pages for a request of 3 pages"),
    ([5, 6], [7, 8, 9], RING, "2 window pages where a window of 9 tokens over 10 holds 3"),
    ([0, 6, 2], [7, 8, 9], RING, "has no SWA slot"),
    ([5, 6, 2], [7, 8, 9], [36, 37, 38, 39, 40], "are not the last 6 positions' rows of request-pool row 2"),
    ([5, 6, 2], [7, 8, 9], [x + 16 * 9 for x in RING], "request-pool row 11; the planning table has 5 rows"),
])
def test_state_lists_that_do_not_fit_the_request_fail_it_and_nothing_is_sent(swa, dsa, ring, why):
    """SGLang's precomputed lists are checked against the request before they become planning
    inputs: a DSA list that is not the request's pages, a window longer than the request or shorter
    than the window kvplan computes (its first pages would read stale map entries: another request's
    SWA pages), a window page that maps to SWA page 0 (SGLang's padding page), ring rows other than
    the last W positions of one request-pool row, or of a row past the planning table."""
    base, mgr, sender = _hybrid_sender(7, [7, 8, 9])
    sender.send(np.array([7, 8, 9]), state_indices=[swa, dsa, ring], num_kv_tokens=10)
    assert concluded(sender, base.KVPoll) == base.KVPoll.Failed and why in mgr.failures[7], mgr.failures[7]
    assert mgr.posted == []


def test_swa_and_dsa_after_a_decode_prefix_start_at_the_prefix_as_sglang_s():
    """SGLang 0.5.23 starts SWA windows and DSA lists at the decode prefix; the adapter declares its
    components ``from_prefix`` (planning.md §6's variant), so SGLang's lists plan as they are: 11
    tokens after a prefix of 8 (3 pages of 4), a window of 9 over 19 tokens from max(8, 10) = 10."""
    from kvplan.planner.contract.batch import Batch
    from kvplan.planner.contract.plan import DestinationLists
    from kvplan.planner.reference.oracle import plan_reference

    base, mgr, sender = _hybrid_sender(8, [9, 10, 11], prefix=8)
    assert all(c.from_prefix for c in mgr.prefill.side.state[:2])
    dst = np.arange(10, 13)  # the decode's pages of [8, 19), its window's SWA pages, its ring rows
    mgr.prefill.peers[0].lists[8] = (DestinationLists(dst, (np.array([3, 4, 7]), dst, np.arange(16, 22))), 0, 8)
    sent = []
    from kvplan.transport.runtime.moving import Done

    mgr.prefill._start_send = lambda transfers, *_: sent.extend(transfers) or Done({})  # what its thread would move
    sender.send(np.array([9, 10, 11]), state_indices=[[5, 6, 2], [9, 10, 11], [16 * 2 + p % 16 for p in range(13, 19)]],
                num_kv_tokens=11)
    assert concluded(sender, base.KVPoll) == base.KVPoll.Success, mgr.failures
    plan = plan_reference(Batch(mgr.prefill.side, [mgr.prefill.peers[0].side], sent))
    (only,) = plan.transfers
    swa, dsa, _ = ((c.src_list.tolist(), c.dst_list.tolist()) for c in only.state)
    assert swa == ([5, 6, 2], [3, 4, 7]) and dsa == ([9, 10, 11], [10, 11, 12])


def test_a_component_declared_from_zero_is_refused_after_a_decode_prefix():
    """Declared ``from_prefix=False`` (kvplan's contract: lists from token 0), the planning row would
    need the prefix's pages, which SGLang never hands the sender: refused, naming the contract."""
    params = [{**p, "from_prefix": False} if k < 2 else p for k, p in enumerate(sglang_sides.STATE_PARAMS)]
    base, mgr, sender = _hybrid_sender(8, [9], prefix=8, state_params=params)
    sender.send(np.array([9]), state_indices=[[5], [9], [16 * 2 + 10]], num_kv_tokens=3)
    assert concluded(sender, base.KVPoll) == base.KVPoll.Failed
    assert "with a decode prefix (8 tokens)" in mgr.failures[8] and "planning.md §6" in mgr.failures[8]
    assert mgr.posted == []


def test_a_last_chunk_whose_tokens_do_not_end_in_its_last_page_fails():
    base, mgr, sender = _hybrid_sender(9, [7, 8, 9])
    sender.send(np.array([7, 8, 9]), state_indices=[[5, 6, 2], [7, 8, 9], RING], num_kv_tokens=13)
    assert concluded(sender, base.KVPoll) == base.KVPoll.Failed and "do not end in its last page" in mgr.failures[9]
    assert mgr.posted == []


def test_two_requests_of_one_request_pool_row_in_a_step_fail_and_nothing_is_sent():
    """Ring rows place a request at its request-pool row; two on one row would share the ring."""
    base, mgr, one = _hybrid_sender(3, [7, 8, 9])  # (skips where SGLang is not installed)
    from kvplan.integrations.sglang.adapter import KVSender

    two = KVSender(mgr, "127.0.0.1:0", 4)
    two.init(3, aux_index=1)
    one.send(np.array([7, 8, 9]), state_indices=[[5, 6, 2], [7, 8, 9], RING], num_kv_tokens=10)
    two.send(np.array([10, 11, 12]), state_indices=[[3, 4, 1], [10, 11, 12], RING], num_kv_tokens=10)
    assert concluded(one, base.KVPoll) == base.KVPoll.Failed and concluded(two, base.KVPoll) == base.KVPoll.Failed
    assert "request-pool row 2, as another request's in this step" in mgr.failures[4]
    assert mgr.posted == []


def test_a_step_s_polls_advance_the_manager_once_and_a_send_makes_the_next_poll_advance_it(monkeypatch):
    """SGLang polls every request of its queues in each step; the manager's work (``progress``, the step's
    batch) is the step's: the first poll does it and the step's other polls do not, a ``send`` since makes
    the next poll do it (its chunk goes into a batch at once), and with no interval every poll does."""
    base = sglang_module("srt.disaggregation.base.conn")
    from kvplan.integrations.sglang import adapter

    kv, aux = sglang_sides.pools(1)
    mgr = _manager(sglang_sides.kv_args_of(base, kv, aux), "PREFILL", max_running_requests=4, context_length=64)
    ran = []
    progress = mgr.progress
    monkeypatch.setattr(mgr, "progress", lambda: (ran.append(1), progress())[-1])
    monkeypatch.setattr(adapter, "ADVANCE_S", 3600.0)  # (no poll of this test is timed out of the gate)
    senders = [adapter.KVSender(mgr, "127.0.0.1:0", room) for room in (1, 2, 3)]
    for sender in senders:
        sender.init(1, aux_index=0)
    mgr._advanced_at = float("-inf")
    ran.clear()
    assert [s.poll() for s in senders for _ in range(3)] == [base.KVPoll.Bootstrapping] * 9
    assert len(ran) == 1
    senders[0].send(np.array([3]))
    senders[1].poll()  # (no decode side published room 1: the batch it went into fails it, with the reason)
    assert len(ran) == 2 and mgr._pending == [] and senders[0].poll() == base.KVPoll.Failed
    monkeypatch.setattr(adapter, "ADVANCE_S", 0.0)
    for _ in range(3):
        senders[2].poll()
    assert len(ran) == 5
