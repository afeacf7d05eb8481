"""A kvplan decode rank's control path in SGLang's protocol (kvplan/integrations/sglang/decode_link.py),
against SGLang 0.5.23's own bootstrap server and parsers on 127.0.0.1: it finds the prefill rank, refuses
a prefill layout it cannot take, registers and asks in frames SGLang's prefill reads, and takes only the
status messages it should (SGLang's own status encoder writes them)."""

import numpy as np

import pytest
import zmq

from kvplan.errors import LayoutError
from kvplan.integrations.sglang.bootstrap import RankRoute, register_rank
from kvplan.integrations.sglang.decode_link import DecodeRankLink
from kvplan.integrations.sglang.wire import Registration, StatusMessage, TransferRequest, status_frames
from tests.integrations.sglang_polls import until
from tests.integrations.test_sglang_rank_link import _pull, _recv
from tests.sglang_real import sglang_module

pytestmark = pytest.mark.sglang

REG = Registration(endpoint="", port=0, session_id="", kv_ptrs=(1 << 40, 2 << 40), kv_item_lens=(256, 256),
                   aux_ptrs=(3 << 40,), tp_rank=0, attn_tp_size=1, kv_layer_ids=(0, 1))


@pytest.fixture
def prefill(server):
    """A prefill rank's PULL socket, registered with SGLang's bootstrap server as an attention-TP-1 prefill."""
    sock, port = _pull()
    register_rank("127.0.0.1", server, RankRoute(rank_ip="127.0.0.1", rank_port=port, page_size=4,
                                                 kv_cache_dtype="bfloat16"))
    yield server, sock
    sock.close()


def test_a_decode_rank_registers_and_asks_in_frames_sglang_s_prefill_reads(prefill):
    conn = sglang_module("srt.disaggregation.mooncake.conn")
    bootstrap, sock = prefill
    link = DecodeRankLink("127.0.0.1:17300", rank_ip="127.0.0.1")
    try:
        layout = link.connect("127.0.0.1", bootstrap, REG, page_size=4, kv_cache_dtype="bfloat16")
        assert layout.attn_tp_size == 1
        theirs = conn.KVArgsRegisterInfo.from_zmq(_recv(sock))  # SGLang's prefill reads the registration
        assert (theirs.endpoint, theirs.dst_port, theirs.mooncake_session_id) == \
            ("127.0.0.1", link.rank_port, "127.0.0.1:17300")
        assert theirs.dst_kv_ptrs == list(REG.kv_ptrs) and theirs.dst_aux_ptrs == list(REG.aux_ptrs)
        link.ask(TransferRequest(9, "", 0, "", np.array([4, 7], np.int32), 2, decode_prefix_len=8))
        info = conn.TransferInfo.from_zmq(_recv(sock))
        assert (info.room, info.dst_kv_indices.tolist(), info.dst_aux_index, info.decode_prefix_len) == \
            (9, [4, 7], 2, 8)
        assert (info.endpoint, info.dst_port) == ("127.0.0.1", link.rank_port)
    finally:
        link.close()


@pytest.fixture
def connected(prefill):
    """A link connected to the prefill, and a PUSH socket into the link, as the prefill's answers come;
    with the prefill's socket (the registration is the first message on it)."""
    bootstrap, sock = prefill
    link = DecodeRankLink("127.0.0.1:17301", rank_ip="127.0.0.1")
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    try:
        link.connect("127.0.0.1", bootstrap, REG, page_size=4, kv_cache_dtype="bfloat16")
        push.connect(f"tcp://127.0.0.1:{link.rank_port}")
        yield link, push, sock
    finally:
        push.close()
        link.close()


def test_only_statuses_of_asked_rooms_from_the_prefill_rank_are_taken(connected):
    link, push, _ = connected
    link.ask(TransferRequest(5, "", 0, "", np.array([1], np.int32), 0))
    push.send_multipart(status_frames(StatusMessage(6, 4, 0)))  # a room never asked for
    push.send_multipart(status_frames(StatusMessage(5, 4, 3)))  # another prefill rank
    push.send_multipart([b"5", b"4x", b"0"])  # malformed
    push.send_multipart([b"ABORT_ACK", b"5", b"0"])  # an abort ack: not a status
    push.send_multipart(status_frames(StatusMessage(5, 4, 0)))
    got = []
    for _ in range(50):
        got += link.poll(timeout=0.1)
        if got:
            break
    assert got == [StatusMessage(5, 4, 0)] and 5 not in link.asked


@pytest.mark.parametrize("route, message", [
    ({"page_size": 8}, "page size is 8, this decode's 4"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "KV cache dtype is fp8_e4m3"),
    ({"decode_allocation_policy": "prefill_complete"}, "'prefill_complete' policy"),
])
def test_a_prefill_layout_this_rank_cannot_take_is_refused(server, route, message):
    register_rank("127.0.0.1", server, RankRoute(**{"rank_ip": "127.0.0.1", "rank_port": 17400, "page_size": 4,
                                                    "kv_cache_dtype": "bfloat16", **route}))
    link = DecodeRankLink("127.0.0.1:17302", rank_ip="127.0.0.1")
    try:
        with pytest.raises(LayoutError, match=message):
            link.connect("127.0.0.1", server, REG, page_size=4, kv_cache_dtype="bfloat16")
        with pytest.raises(LayoutError, match="has not connected"):
            link.ask(TransferRequest(1, "", 0, "", np.array([1], np.int32), 0))
    finally:
        link.close()


def test_a_prefill_of_several_ranks_is_refused(server):
    for rank in (0, 1):
        register_rank("127.0.0.1", server, RankRoute(rank_ip="127.0.0.1", rank_port=17500 + rank, page_size=4,
                                                     kv_cache_dtype="bfloat16", attn_tp_size=2, attn_tp_rank=rank))
    link = DecodeRankLink("127.0.0.1:17303", rank_ip="127.0.0.1")
    try:
        with pytest.raises(LayoutError, match="attention TP 2.*one prefill rank"):
            link.connect("127.0.0.1", server, REG, page_size=4, kv_cache_dtype="bfloat16")
    finally:
        link.close()


def test_an_abort_is_sent_as_sglang_s_and_only_its_own_ack_counts(connected):
    common = sglang_module("srt.disaggregation.common.conn")
    link, push, sock = connected
    _recv(sock)  # the registration
    link.ask(TransferRequest(5, "", 0, "", np.array([1], np.int32), 0))
    _recv(sock)
    link.abort(5)
    theirs = common.AbortNotification.from_zmq(_recv(sock))  # SGLang's prefill reads it
    assert (theirs.room, theirs.decode_ip, theirs.decode_port) == (5, "127.0.0.1", link.rank_port)
    assert 5 not in link.asked and link.aborting == {5: theirs.generation}
    push.send_multipart(common.AbortAck(room=5, prefill_rank=0, generation=theirs.generation + 1).to_zmq())
    push.send_multipart(common.AbortAck(room=5, prefill_rank=0, generation=theirs.generation).to_zmq())
    for _ in range(50):
        link.poll(timeout=0.1)
        if link.acked:
            break
    assert link.acked == {5} and not link.aborting  # the other generation's ack was not taken


@pytest.mark.engines
def test_a_kvplan_decode_whose_request_gets_no_status_fails_it_at_its_deadline_and_aborts_it(prefill):
    """The adapter's decode manager with SGLang's protocol: a request the prefill never answers fails at
    the manager's deadline, naming it, and the prefill is told to drop it (SGLang's abort)."""
    import types

    from kvplan.integrations.sglang.adapter import KVManager, KVReceiver
    from tests.integrations import sglang_sides

    base = sglang_module("srt.disaggregation.base.conn")
    common = sglang_module("srt.disaggregation.common.conn")
    utils = sglang_module("srt.disaggregation.utils")
    bootstrap, sock = prefill
    kv, aux = sglang_sides.pools(None)
    server_args = types.SimpleNamespace(disaggregation_transfer_backend="mooncake", kvplan_protocol="sglang",
                                        kvplan_timeout_s=0.5, host="127.0.0.1", kvplan_host="127.0.0.1")
    mgr = KVManager(sglang_sides.kv_args_of(base, kv, aux), utils.DisaggregationMode.DECODE, server_args)
    try:
        receiver = KVReceiver(mgr, f"127.0.0.1:{bootstrap}", 12)
        receiver.init(0)
        assert _registered_session(sock) == mgr.engine.segment  # it registered its Mooncake segment (off-thread)
        until(lambda: receiver.poll() != base.KVPoll.Bootstrapping)
        assert receiver.poll() == base.KVPoll.WaitingForInput
        receiver.send_metadata(np.array([3, 4], np.int32), aux_index=1)
        _recv(sock)  # the request
        for _ in range(200):
            if receiver.poll() == base.KVPoll.Failed:
                break
            sock.poll(10)
        assert receiver.poll() == base.KVPoll.Failed
        assert "no status from the prefill within 0.5 s" in mgr.failures[12]
        assert common.AbortNotification.from_zmq(_recv(sock)).room == 12
    finally:
        mgr.close()


def _registered_session(sock) -> str:
    conn = sglang_module("srt.disaggregation.mooncake.conn")
    return conn.KVArgsRegisterInfo.from_zmq(_recv(sock)).mooncake_session_id
