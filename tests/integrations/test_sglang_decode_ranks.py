"""SGLang's decode ranks as peers of a kvplan prefill endpoint (kvplan/integrations/sglang/decode_ranks.py),
driven by SGLang 0.5.23's own decode-side message builders over real ZeroMQ sockets on 127.0.0.1: a
registration pairs (or is refused, and its requests fail naming why), a request becomes its peer's
destination lists, a request spread over two decode ranks goes to both and a dummy's to none, an abort
drops the room and is acknowledged, and every status goes to the decode as SGLang's own parser reads it."""

import threading
import time
import types

import numpy as np
import pytest
import torch
import zmq

from kvplan.errors import LayoutError
from kvplan.integrations.sglang.decode_ranks import DecodeRanks
from kvplan.integrations.sglang.kv_args import side_from_kv_args, side_from_registration
from kvplan.integrations.sglang.rank_link import FAILED, SUCCESS, PrefillRankLink
from kvplan.transport.prefill import PrefillEndpoint
from tests.integrations import sglang_sides
from tests.integrations.sglang_polls import until
from tests.integrations.test_sglang_rank_link import _pull, _recv
from tests.integrations.test_sglang_wire import sglang_decode
from tests.sglang_real import sglang_module
from tests.transport.fakes import FakeEngine

pytestmark = pytest.mark.sglang


@pytest.fixture
def served():
    """A prefill endpoint over the test pools, its rank link, and the DecodeRanks that serve through it."""
    base = sglang_module("srt.disaggregation.base.conn")
    kv, aux = sglang_sides.pools(1)
    args = sglang_sides.kv_args_of(base, kv, aux)
    table = torch.zeros((4, 64), dtype=torch.int32)
    endpoint = PrefillEndpoint(side_from_kv_args(args, mla=False, req_to_token=table), FakeEngine(), [])
    lens = sglang_sides.decode_lens(False)

    def side_of(reg):
        return side_from_registration(reg, args, lens if reg.tp_rank == 0 else None, mla=False, attn_tp_size=1)

    link = PrefillRankLink(rank_ip="127.0.0.1", backend="mooncake")
    ranks = DecodeRanks(endpoint, link, side_of)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{link.rank_port}")
    yield ranks, push, (kv, aux)
    push.close()
    ranks.close()


def _decode(tp_rank: int, port: int, pools):
    """SGLang's decode-side message builders over decode pools shaped like the test's (rank 1 has no
    lengths given for it, so it cannot pair)."""
    conn = sglang_module("srt.disaggregation.mooncake.conn")
    kv, aux = pools
    return sglang_decode(conn, kv_ptrs=[t.data_ptr() for t in kv], kv_item_lens=[sglang_sides.PAGE * 64] * len(kv),
                         aux_ptrs=[aux.data_ptr()], state_ptrs=[], state_item_lens=[], state_dims=[],
                         kv_layer_ids=list(range(len(kv))), state_layer_ids=[], tp_rank=tp_rank, attn_tp_size=1,
                         endpoint="127.0.0.1", port=port, session=f"127.0.0.1:{17200 + tp_rank}")


def _ask(push, decode, room, pages, aux, prefix=0, required=1, dummy=False):
    push.send_multipart(decode.build_receiver_metadata_message(
        bootstrap_room=room, required_dst_info_num=required, kv_indices=np.array(pages, np.int32), aux_index=aux,
        state_indices=None, decode_prefix_len=prefix, is_dummy=dummy))


def _progress(ranks, count):
    """DecodeRanks.progress until ``count`` rooms were published or failed."""
    published, failed = [], []
    for _ in range(50):
        p, f = ranks.progress(timeout=0.1)
        published += p
        failed += f
        if len(published) + len(failed) >= count:
            break
    return published, failed


def test_a_registered_rank_becomes_a_peer_and_its_request_its_lists(served):
    ranks, push, pools = served
    (pull, port) = _pull()
    decode = _decode(0, port, pools)
    push.send_multipart(decode.build_receiver_registration_message())
    _ask(push, decode, 7, [5, 6, 9], aux=3, prefix=8)
    assert _progress(ranks, 1) == ([7], [])
    peer = ranks.endpoint.peers[ranks.sessions["127.0.0.1:17200"]]
    assert peer.name == "127.0.0.1:17200" and not peer.notified and peer.notification(None) == b""
    assert peer.side.kv.num_pages == sglang_sides.PAGES and peer.side.aux[0].num_items == sglang_sides.AUX_ROWS
    lists, aux_row, prefix = peer.lists[7]
    assert lists.pages.tolist() == [5, 6, 9] and (aux_row, prefix) == (3, 8)
    ranks.report(7, ok=True)
    assert decode.parse_kv_status_message(_recv(pull)) == (7, SUCCESS, 0, None)  # SGLang reads it
    assert 7 not in peer.lists and 7 not in ranks.link.requests
    pull.close()


class _WatchedPeers(list):
    """An endpoint's peer list that records which thread added to it."""

    def __init__(self):
        super().__init__()
        self.adders: set[str] = set()

    def append(self, peer):
        self.adders.add(threading.current_thread().name)
        super().append(peer)


def test_on_a_started_endpoint_a_rank_s_peer_and_lists_are_given_to_its_progress_thread(served):
    """The prefill endpoint runs its progress thread (SGLang's scheduler thread only submits and reads):
    the rank's peer is made there and its lists are given there, between batches; this thread writes
    neither. The room is published at once; its lists are there once the thread has run."""
    ranks, push, pools = served
    ranks.endpoint.peers = watched = _WatchedPeers()
    ranks.endpoint.start()
    (pull, port) = _pull()
    try:
        decode = _decode(0, port, pools)
        push.send_multipart(decode.build_receiver_registration_message())
        _ask(push, decode, 7, [5, 6, 9], aux=3, prefix=8)
        assert _progress(ranks, 1) == ([7], [])
        until(lambda: len(watched) == 1 and 7 in watched[0].lists)
        assert watched.adders == {"kvplan-prefill-progress"}
        assert watched[0].lists[7][0].pages.tolist() == [5, 6, 9]
    finally:
        ranks.endpoint.close()
        pull.close()


def test_a_rank_that_cannot_pair_is_refused_and_its_requests_fail_naming_why(served):
    ranks, push, pools = served
    pull, port = _pull()
    decode = _decode(1, port, pools)  # no buffer lengths are known for it
    push.send_multipart(decode.build_receiver_registration_message())
    _ask(push, decode, 8, [1], aux=0)
    published, failed = _progress(ranks, 1)
    assert published == [] and [room for room, _ in failed] == [8]
    assert "cannot pair with this prefill" in failed[0][1] and "registers no buffer lengths" in failed[0][1]
    assert "127.0.0.1:17201" in ranks.refused and not ranks.sessions
    ranks.report(8, ok=False, reason=failed[0][1])
    assert decode.parse_kv_status_message(_recv(pull))[:2] == (8, FAILED)
    pull.close()


def test_a_request_spread_over_two_decode_ranks_goes_to_both_and_a_dummy_s_to_none(served):
    """A room two decode ranks ask for becomes both peers' lists (one batch then writes each rank its
    share); a room only a dummy rank asks for has nothing to send here, and its status goes to nobody."""
    ranks, push, pools = served
    pulls = [_pull() for _ in range(2)]
    decodes = [_decode(0, pulls[0][1], pools), _decode(0, pulls[1][1], pools)]
    decodes[1].engine = types.SimpleNamespace(get_session_id=lambda: "127.0.0.1:17299")
    for d in decodes:
        push.send_multipart(d.build_receiver_registration_message())
    for d in decodes:
        _ask(push, d, 9, [2], aux=1, required=2)
    assert _progress(ranks, 1) == ([9], [])
    assert [9 in p.lists for p in ranks.endpoint.peers] == [True, True]
    _ask(push, decodes[1], 10, [], aux=None, dummy=True)
    assert _progress(ranks, 1) == ([10], []) and ranks.dummies == {10}
    assert not any(10 in p.lists for p in ranks.endpoint.peers)
    ranks.report(10, ok=True)
    assert not pulls[1][0].poll(300) and not ranks.dummies
    for sock, _ in pulls:
        sock.close()


def test_a_room_whose_second_rank_registered_in_the_same_poll_after_the_first_rank_s_request_goes_to_both(served):
    """The link reads every message of a poll before it reports them, so a room can be complete (both ranks'
    requests in) at the first rank's request, before the second rank's registration is reported: the
    registrations of a poll pair first (a fresh-clone CI run crashed here, session 27)."""
    ranks, push, pools = served
    pulls = [_pull() for _ in range(2)]
    decodes = [_decode(0, pulls[0][1], pools), _decode(0, pulls[1][1], pools)]
    decodes[1].engine = types.SimpleNamespace(get_session_id=lambda: "127.0.0.1:17298")
    push.send_multipart(decodes[0].build_receiver_registration_message())
    _ask(push, decodes[0], 11, [3], aux=1, required=2)
    push.send_multipart(decodes[1].build_receiver_registration_message())
    _ask(push, decodes[1], 11, [4], aux=1, required=2)
    time.sleep(0.3)  # (all four messages in before the one poll that reports them)
    assert _progress(ranks, 1) == ([11], [])
    assert [p.lists[11][0].pages.tolist() for p in ranks.endpoint.peers] == [[3], [4]]
    for sock, _ in pulls:
        sock.close()


def test_an_abort_drops_the_room_and_is_acknowledged(served):
    common = sglang_module("srt.disaggregation.common.conn")
    ranks, push, pools = served
    pull, port = _pull()
    decode = _decode(0, port, pools)
    push.send_multipart(decode.build_receiver_registration_message())
    _ask(push, decode, 10, [4], aux=2)
    assert _progress(ranks, 1) == ([10], [])
    push.send_multipart(common.AbortNotification(room=10, decode_ip="127.0.0.1", decode_port=port,
                                                 generation=2).to_zmq())
    assert _progress(ranks, 1) == ([], [(10, "the decode side aborted it")])
    assert 10 not in ranks.endpoint.peers[0].lists
    assert _recv(pull)[:2] == [b"ABORT_ACK", b"10"]
    pull.close()


def test_a_registration_without_the_decode_s_lengths_is_refused_naming_them():
    reg = types.SimpleNamespace(kv_ptrs=(1,), kv_item_lens=(64,), aux_ptrs=(2,), tp_rank=0, attn_tp_size=1,
                                state_ptrs=((3,),), state_item_lens=((8,),), state_dim_per_tensor=((0,),), dcp_size=1)
    local = types.SimpleNamespace(page_size=4, kv_head_num=1, total_kv_head_num=1, aux_item_lens=[8],
                                  state_types=["mamba"])
    with pytest.raises(LayoutError, match="lack \\['state_data_lens'\\]"):
        side_from_registration(reg, local, {"kv_data_lens": [256], "aux_data_lens": [64]}, mla=False, attn_tp_size=1)
    with pytest.raises(LayoutError, match="registers 0 state components, this side 1"):
        side_from_registration(types.SimpleNamespace(**{**vars(reg), "state_ptrs": ()}), local,
                               {"kv_data_lens": [256], "aux_data_lens": [64], "state_data_lens": [[64]]},
                               mla=False, attn_tp_size=1)
    with pytest.raises(LayoutError, match="decode context parallelism"):
        side_from_registration(types.SimpleNamespace(**{**vars(reg), "dcp_size": 2}), local, {}, mla=False,
                               attn_tp_size=1)


def test_a_nixl_registration_whose_pools_disagree_with_the_lengths_given_is_refused():
    """NIXL's registration carries the KV slot count and the state lengths: they must be the pools the
    lengths given for the decode describe."""
    reg = types.SimpleNamespace(kv_ptrs=(1, 1 << 20), kv_item_lens=(64, 64), aux_ptrs=(2,), tp_rank=0,
                                attn_tp_size=1, state_ptrs=((3,),), state_item_lens=((8,),),
                                state_dim_per_tensor=((0,),), dcp_size=1, num_slots=4, state_data_lens=((64,),))
    local = types.SimpleNamespace(page_size=4, kv_head_num=1, total_kv_head_num=1, aux_item_lens=[8],
                                  state_types=["mamba"])
    lens = {"kv_data_lens": [256, 256], "aux_data_lens": [64], "state_data_lens": [[64]]}
    assert side_from_registration(reg, local, lens, mla=False, attn_tp_size=1).kv.num_pages == 4
    with pytest.raises(LayoutError, match="registers 4 KV slots; the lengths given for it hold 8"):
        side_from_registration(reg, local, {**lens, "kv_data_lens": [512, 512]}, mla=False, attn_tp_size=1)
    with pytest.raises(LayoutError, match="registers state buffer lengths \\[\\[64\\]\\]"):
        side_from_registration(reg, local, {**lens, "state_data_lens": [[128]]}, mla=False, attn_tp_size=1)
