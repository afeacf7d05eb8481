"""A kvplan prefill rank's control path in SGLang's protocol (kvplan/integrations/sglang/rank_link.py),
driven by SGLang 0.5.23's own decode-side message builders over real ZeroMQ sockets on 127.0.0.1, and
answered with frames that SGLang's own parsers read: registrations and transfer requests of two decode
ranks (one of them a dummy), the room's status to the other, an abort and its ack; malformed messages and
requests from unregistered sessions are dropped, nothing of them kept."""

import numpy as np
import pytest
import zmq

from kvplan.integrations.sglang.rank_link import SUCCESS, PrefillRankLink
from tests.integrations.test_sglang_wire import sglang_decode
from tests.sglang_real import sglang_module

pytestmark = pytest.mark.sglang


def _pull():
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    return sock, sock.bind_to_random_port("tcp://127.0.0.1")


def _recv(sock):
    assert sock.poll(5000), "no message within 5 s"
    return sock.recv_multipart()


def _poll_until(link, count):
    events = []
    for _ in range(50):
        events += link.poll(timeout=0.1)
        if len(events) >= count:
            break
    return events


@pytest.fixture
def link():
    link = PrefillRankLink(rank_ip="127.0.0.1", backend="mooncake", prefill_rank=3)
    yield link
    link.close()


def test_a_kvplan_prefill_rank_answers_sglang_s_decode_ranks(link):
    conn = sglang_module("srt.disaggregation.mooncake.conn")
    common = sglang_module("srt.disaggregation.common.conn")
    pulls = [_pull() for _ in range(2)]
    decodes = [sglang_decode(conn, kv_ptrs=[1 << 40, 2 << 40], kv_item_lens=[4096, 4096], aux_ptrs=[3 << 40],
                             state_ptrs=[], state_item_lens=[], state_dims=[], kv_layer_ids=[0, 1], state_layer_ids=[],
                             tp_rank=k, attn_tp_size=2, endpoint="127.0.0.1", port=port, session=f"127.0.0.1:{17100 + k}")
               for k, (_, port) in enumerate(pulls)]
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{link.rank_port}")
    try:
        for d in decodes:
            push.send_multipart(d.build_receiver_registration_message())
        push.send_multipart(decodes[0].build_receiver_metadata_message(
            bootstrap_room=42, required_dst_info_num=2, kv_indices=np.array([3, 4], np.int32), aux_index=1,
            state_indices=None, decode_prefix_len=0, is_dummy=False))
        events = _poll_until(link, 3)
        assert events == [("registered", "127.0.0.1:17100"), ("registered", "127.0.0.1:17101"), ("request", 42)]
        assert not link.complete(42)  # one of the two decode ranks has asked
        push.send_multipart(decodes[1].build_receiver_metadata_message(
            bootstrap_room=42, required_dst_info_num=2, kv_indices=np.zeros(0, np.int32), aux_index=None,
            state_indices=None, decode_prefix_len=0, is_dummy=True))
        assert _poll_until(link, 1) == [("request", 42)] and link.complete(42)
        assert link.requests[42]["127.0.0.1:17100"].dst_pages.tolist() == [3, 4]
        assert link.requests[42]["127.0.0.1:17101"].is_dummy
        assert link.registrations["127.0.0.1:17101"].tp_rank == 1

        link.send_status(42, SUCCESS)
        assert decodes[0].parse_kv_status_message(_recv(pulls[0][0])) == (42, SUCCESS, 3, None)  # SGLang reads it
        assert not pulls[1][0].poll(300)  # the dummy rank is told nothing, as by SGLang's prefill

        pull0, port0 = pulls[0]
        push.send_multipart(common.AbortNotification(room=43, decode_ip="127.0.0.1", decode_port=port0,
                                                     generation=5).to_zmq())
        assert _poll_until(link, 1) == [("abort", 43)]
        link.ack_abort(43)
        ack = common.AbortAck.from_zmq(_recv(pull0))
        assert (ack.room, ack.prefill_rank, ack.generation) == (43, 3, 5)

        push.send_multipart([b"None", b"127.0.0.1"])  # a registration cut short
        push.send_multipart(sglang_decode(conn, kv_ptrs=[1], kv_item_lens=[1], aux_ptrs=[], state_ptrs=[],
                                          state_item_lens=[], state_dims=[], kv_layer_ids=[], state_layer_ids=[],
                                          tp_rank=0, attn_tp_size=1, endpoint="127.0.0.1", port=port0,
                                          session="127.0.0.1:9").build_receiver_metadata_message(
            bootstrap_room=44, required_dst_info_num=1, kv_indices=np.array([1], np.int32), aux_index=0,
            state_indices=None, decode_prefix_len=0, is_dummy=False))  # from a session never registered
        assert link.poll(timeout=0.5) == [] and 44 not in link.requests and len(link.registrations) == 2
    finally:
        push.close()
        for sock, _ in pulls:
            sock.close()
