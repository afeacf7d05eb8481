"""SGLang 0.5.23's control messages (Mooncake backend): kvplan's frames read by SGLang's own
parsers (``TransferInfo.from_zmq``, ``KVArgsRegisterInfo.from_zmq``), and the frames SGLang's own
decode builds (``build_receiver_registration_message``, ``build_receiver_metadata_message``) read
by kvplan's; malformed frames refused with the field named. The prefill's status messages, of the
Mooncake and the NIXL manager, are equal frame for frame and read alike both ways; so are aborts and
their acks."""

import types
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.errors import PeerError
from kvplan.integrations.sglang.wire import (
    STATUS_FRAMING,
    Abort,
    AbortAck,
    Registration,
    StatusMessage,
    TransferRequest,
    abort_ack_frames,
    abort_frames,
    parse_abort,
    parse_abort_ack,
    parse_registration,
    parse_status,
    parse_transfer,
    registration_frames,
    status_frames,
    transfer_frames,
)
from tests.sglang_real import sglang_module

pytestmark = pytest.mark.sglang

ptr = st.integers(0, 2**64 - 1)
small = st.integers(0, 2**32 - 1)
nested = st.lists(st.lists(small, max_size=4), max_size=3)


@pytest.fixture(scope="module")
def conn():
    return sglang_module("srt.disaggregation.mooncake.conn")


def sglang_decode(conn, *, kv_ptrs, kv_item_lens, aux_ptrs, state_ptrs, state_item_lens, state_dims, kv_layer_ids,
                  state_layer_ids, tp_rank, attn_tp_size, endpoint, port, session):
    """SGLang's Mooncake manager on the decode side, with what its message builders read."""
    base = sglang_module("srt.disaggregation.base.conn")
    args = base.KVArgs()
    args.kv_data_ptrs, args.kv_item_lens, args.aux_data_ptrs = kv_ptrs, kv_item_lens, aux_ptrs
    args.state_data_ptrs, args.state_item_lens, args.state_dim_per_tensor = state_ptrs, state_item_lens, state_dims
    args.kv_layer_ids, args.state_layer_ids, args.engine_rank = kv_layer_ids, state_layer_ids, tp_rank
    mgr = object.__new__(conn.MooncakeKVManager)
    mgr.kv_args, mgr.local_ip, mgr.rank_port, mgr.attn_tp_size = args, endpoint, port, attn_tp_size
    mgr.dcp_size, mgr.dcp_rank, mgr.enable_staging = 1, 0, False
    mgr.engine = types.SimpleNamespace(get_session_id=lambda: session)
    return mgr


@settings(max_examples=40, deadline=None)
@given(kv=st.lists(st.tuples(ptr, st.integers(1, 2**40)), min_size=1, max_size=6), aux=st.lists(ptr, max_size=3),
       state_ptrs=st.lists(st.lists(ptr, max_size=3), max_size=3), state_item_lens=nested, state_dims=nested,
       layer_ids=st.lists(small, max_size=4), state_layer_ids=nested, tp_rank=st.integers(0, 63),
       tp=st.integers(1, 64), port=st.integers(1, 65535))
def test_registrations_read_alike_both_ways(conn, kv, aux, state_ptrs, state_item_lens, state_dims, layer_ids,
                                            state_layer_ids, tp_rank, tp, port):
    reg = Registration("127.0.0.1", port, f"127.0.0.1:{port}", tuple(p for p, _ in kv), tuple(n for _, n in kv),
                       tuple(aux), tp_rank, tp, tuple(map(tuple, state_ptrs)), tuple(map(tuple, state_item_lens)),
                       tuple(map(tuple, state_dims)), tuple(layer_ids), tuple(map(tuple, state_layer_ids)))
    theirs = conn.KVArgsRegisterInfo.from_zmq(registration_frames(reg))  # SGLang reads ours
    assert (theirs.endpoint, theirs.dst_port, theirs.mooncake_session_id) == (reg.endpoint, port, reg.session_id)
    assert (theirs.dst_kv_ptrs, theirs.dst_aux_ptrs, theirs.dst_kv_item_lens) == (
        list(reg.kv_ptrs), list(reg.aux_ptrs), list(reg.kv_item_lens))
    assert (theirs.dst_tp_rank, theirs.dst_attn_tp_size, theirs.dst_kv_item_len) == (tp_rank, tp, reg.kv_item_lens[0])
    assert theirs.dst_state_data_ptrs == [list(x) for x in reg.state_ptrs]
    assert theirs.dst_state_item_lens == [list(x) for x in reg.state_item_lens]
    assert theirs.dst_state_dim_per_tensor == [list(x) for x in reg.state_dim_per_tensor]
    assert (theirs.dst_kv_layer_ids, theirs.dst_state_layer_ids) == (list(layer_ids), [list(x) for x in state_layer_ids])
    assert (theirs.staging_base_ptr, theirs.staging_total_size, theirs.dst_dcp_size) == (0, 0, 1)
    mgr = sglang_decode(conn, kv_ptrs=list(reg.kv_ptrs), kv_item_lens=list(reg.kv_item_lens), aux_ptrs=aux,
                        state_ptrs=state_ptrs, state_item_lens=state_item_lens, state_dims=state_dims,
                        kv_layer_ids=layer_ids, state_layer_ids=state_layer_ids, tp_rank=tp_rank, attn_tp_size=tp,
                        endpoint="127.0.0.1", port=port, session=reg.session_id)
    assert parse_registration(mgr.build_receiver_registration_message()) == reg  # we read SGLang's


@settings(max_examples=60, deadline=None)
@given(room=st.integers(0, 2**63 - 1), pages=st.lists(st.integers(0, 2**31 - 1), max_size=20),
       aux=st.integers(0, 2**20), state=st.lists(st.lists(st.integers(-2**31, 2**31 - 1), max_size=5), max_size=4),
       required=st.integers(1, 8), prefix=st.integers(0, 2**20), dummy=st.booleans())
def test_transfer_requests_read_alike_both_ways(conn, room, pages, aux, state, required, prefix, dummy):
    pages = np.array(pages, np.int32)
    req = TransferRequest(room, "127.0.0.1", 17000, "127.0.0.1:17001", pages if not dummy else np.zeros(0, np.int32),
                          None if dummy else aux, () if dummy else tuple(map(tuple, state)), required, prefix, dummy)
    theirs = conn.TransferInfo.from_zmq(transfer_frames(req))
    assert (theirs.room, theirs.is_dummy, theirs.required_dst_info_num) == (room, dummy, required)
    assert theirs.dst_kv_indices.tolist() == req.dst_pages.tolist() and theirs.dst_aux_index == req.aux_index
    assert theirs.dst_state_indices == [list(x) for x in req.state_lists]
    assert (theirs.decode_prefix_len or 0) == prefix
    mgr = sglang_decode(conn, kv_ptrs=[], kv_item_lens=[], aux_ptrs=[], state_ptrs=[], state_item_lens=[],
                        state_dims=[], kv_layer_ids=[], state_layer_ids=[], tp_rank=0, attn_tp_size=1,
                        endpoint="127.0.0.1", port=17000, session="127.0.0.1:17001")
    frames = mgr.build_receiver_metadata_message(bootstrap_room=room, required_dst_info_num=required, kv_indices=pages,
                                                 aux_index=aux, state_indices=[list(x) for x in state],
                                                 decode_prefix_len=prefix, is_dummy=dummy)
    ours = parse_transfer(frames)
    assert (ours.room, ours.is_dummy, ours.required_dst_info_num, ours.decode_prefix_len) == (room, dummy, required,
                                                                                             prefix)
    assert ours.dst_pages.tolist() == ([] if dummy else pages.tolist())
    assert list(map(list, ours.state_lists)) == ([] if dummy else [list(x) for x in state])
    assert ours.aux_index == (None if dummy else aux)


@pytest.mark.parametrize("index, blob, field", [(4, b"\x01\x02\x03", "kv_ptrs"), (7, b"x", "tp_rank"),
                                                (19, b"\x00" * 9, "kv_item_lens"), (6, b"\x05\x00", "state_ptrs")])
def test_a_malformed_registration_is_refused_naming_the_field(index, blob, field):
    frames = registration_frames(Registration("127.0.0.1", 1, "s", (4096,), (64,), (), 0, 1))
    frames[index] = blob
    with pytest.raises(PeerError, match=field):
        parse_registration(frames)


def test_a_malformed_transfer_request_is_refused_naming_the_field():
    frames = transfer_frames(TransferRequest(1, "127.0.0.1", 1, "s", np.array([3], np.int32), 0))
    with pytest.raises(PeerError, match="dst_pages"):
        parse_transfer(frames[:4] + [b"\x01\x02"] + frames[5:])
    with pytest.raises(PeerError, match="frames"):
        parse_transfer(frames[:3])


def sglang_prefill(backend: str, *, tp_rank: int, pp: tuple[int, int], cp: tuple[int, int]):
    """SGLang's manager of ``backend`` on the prefill side, with what its status codec reads."""
    module = sglang_module(f"srt.disaggregation.{backend}.conn")
    mgr = object.__new__(module.MooncakeKVManager if backend == "mooncake" else module.NixlKVManager)
    mgr.attn_tp_rank, (mgr.pp_size, mgr.pp_rank), (mgr.attn_cp_size, mgr.attn_cp_rank) = tp_rank, pp, cp
    return mgr


reasons = st.none() | st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)


@settings(max_examples=40, deadline=None)
@given(backend=st.sampled_from(sorted(STATUS_FRAMING)), room=st.integers(0, 2**63 - 1), status=st.integers(0, 4),
       tp_rank=st.integers(0, 63), pp=st.sampled_from([(1, 0), (2, 1), (4, 2)]), cp=st.sampled_from([(1, 0), (2, 1)]),
       reason=reasons)
def test_status_messages_are_equal_and_read_alike_both_ways(backend, room, status, tp_rank, pp, cp, reason):
    mgr = sglang_prefill(backend, tp_rank=tp_rank, pp=pp, cp=cp)
    rank = mgr._prefill_unique_rank()
    theirs = mgr._encode_kv_status_message(bootstrap_room=room, status=status, failure_reason=reason)
    assert status_frames(StatusMessage(room, status, rank, reason), backend) == theirs
    carried = (reason or None) if STATUS_FRAMING[backend][1] else None
    assert parse_status(theirs, backend) == StatusMessage(room, status, rank, carried)
    assert mgr.parse_kv_status_message(status_frames(StatusMessage(room, status, rank, reason), backend)) == \
        (room, status, rank, carried)


def test_a_message_of_another_kind_is_not_a_status():
    """NIXL's decode socket carries tagged messages of several kinds: another tag is not a status
    (both parsers say so); Mooncake's status has no tag."""
    nixl = sglang_prefill("nixl", tp_rank=0, pp=(1, 0), cp=(1, 0))
    other = [b"CHUNK_READY", b"1", b"2", b"3"]
    assert parse_status(other, "nixl") is None and nixl.parse_kv_status_message(other) is None
    with pytest.raises(ValueError, match="no status framing"):
        parse_status([b"1", b"4", b"0"], "mori")


@pytest.mark.parametrize("frames, field", [
    ([b"7", b"4"], "2 frames"),
    ([b"seven", b"4", b"0"], "room"),
    ([b"7", b"4", b"x"], "prefill_rank"),
    ([b"7", b"9", b"0"], "no KVPoll state"),
    ([b"7", b"0", b"0", b"\xff\xfe"], "not UTF-8"),
])
def test_a_malformed_status_is_refused_naming_the_field(frames, field):
    """kvplan's reader is strict where SGLang's drops or mends: a state outside ``KVPoll`` and a
    reason that is not UTF-8 are refused (SGLang passes the first through and replaces the bytes of
    the second)."""
    with pytest.raises(PeerError, match=field):
        parse_status(frames, "mooncake")
    mgr = sglang_prefill("mooncake", tp_rank=0, pp=(1, 0), cp=(1, 0))
    if field == "no KVPoll state":
        assert mgr.parse_kv_status_message(frames) == (7, 9, 0, None)
    if field == "not UTF-8":
        assert mgr.parse_kv_status_message(frames)[3] == "\ufffd\ufffd"


@settings(max_examples=40, deadline=None)
@given(room=st.integers(0, 2**63 - 1), address=st.booleans(), port=st.integers(1, 65535),
       generation=st.none() | st.integers(0, 2**31), prefill_rank=st.integers(0, 255))
def test_aborts_and_their_acks_are_equal_and_read_alike_both_ways(room, address, port, generation, prefill_rank):
    common = sglang_module("srt.disaggregation.common.conn")
    ip, port = ("127.0.0.1", port) if address else (None, None)
    theirs = common.AbortNotification(room=room, decode_ip=ip, decode_port=port, generation=generation)
    expected = Abort(room, ip, port, generation if address else None)
    assert abort_frames(Abort(room, ip, port, generation)) == theirs.to_zmq()
    assert parse_abort(theirs.to_zmq()) == expected
    back = common.AbortNotification.from_zmq(abort_frames(expected))
    assert (back.room, back.decode_ip, back.decode_port, back.generation) == (room, ip, port, expected.generation)
    ack = common.AbortAck(room=room, prefill_rank=prefill_rank, generation=generation)
    assert abort_ack_frames(AbortAck(room, prefill_rank, generation)) == ack.to_zmq()
    assert parse_abort_ack(ack.to_zmq()) == AbortAck(room, prefill_rank, generation)
    assert common.AbortAck.from_zmq(abort_ack_frames(AbortAck(room, prefill_rank, generation))) == ack


@pytest.mark.parametrize("frames, field", [
    ([b"ABORT"], "1 frames"),
    ([b"ABORT", b"r7"], "room"),
    ([b"ABORT", b"7", b"127.0.0.1"], "3 frames"),
    ([b"ABORT", b"7", b"127.0.0.1", b"port"], "decode_port"),
    ([b"ABORT", b"7", b"127.0.0.1", b"0"], "no TCP port"),
    ([b"ABORT", b"7", b"127.0.0.1", b"17000", b"g"], "generation"),
    ([b"ABORT_ACK", b"7"], "2 frames"),
    ([b"ABORT_ACK", b"7", b"rank"], "prefill_rank"),
])
def test_a_malformed_abort_is_refused_naming_the_field(frames, field):
    """Where SGLang keeps the room of an abort whose return address or generation is malformed (and
    so never acknowledges it), kvplan refuses the message; other kinds are not aborts."""
    parse = parse_abort_ack if frames[0] == b"ABORT_ACK" else parse_abort
    with pytest.raises(PeerError, match=field):
        parse(frames)
    common = sglang_module("srt.disaggregation.common.conn")
    if field in ("decode_port", "generation"):
        assert common.AbortNotification.from_zmq(frames).room == 7
    assert parse_abort([b"ABORT_ACK", b"7", b"0"]) is None and parse_abort_ack([b"ABORT", b"7"]) is None



# -- NIXL's framing ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nixl_conn():
    return sglang_module("srt.disaggregation.nixl.conn")


def nixl_decode(nixl_conn, reg: Registration):
    """SGLang's NIXL manager on the decode side, with what its message builders read (its agent a stand-in
    that answers its name and metadata)."""
    base = sglang_module("srt.disaggregation.base.conn")
    args = base.KVArgs()
    args.kv_data_ptrs, args.kv_item_lens, args.aux_data_ptrs = list(reg.kv_ptrs), list(reg.kv_item_lens), list(reg.aux_ptrs)
    args.kv_data_mem_kinds = list(reg.kv_mem_kinds)
    args.kv_data_lens = [reg.num_slots * n for n in reg.kv_item_lens]
    args.state_data_ptrs, args.state_item_lens = [list(x) for x in reg.state_ptrs], [list(x) for x in reg.state_item_lens]
    args.state_data_lens = [list(x) for x in reg.state_data_lens]
    args.state_dim_per_tensor = [list(x) for x in reg.state_dim_per_tensor]
    args.kv_layer_ids, args.state_layer_ids = list(reg.kv_layer_ids), [list(x) for x in reg.state_layer_ids]
    args.engine_rank, args.gpu_id = reg.tp_rank, reg.gpu_id
    mgr = object.__new__(nixl_conn.NixlKVManager)
    mgr.kv_args, mgr.local_ip, mgr.rank_port, mgr.attn_tp_size = args, reg.endpoint, reg.port, reg.attn_tp_size
    mgr.dcp_size, mgr.dcp_rank, mgr.enable_staging = 1, 0, False
    mgr.agent = types.SimpleNamespace(name=reg.session_id, get_agent_metadata=lambda: reg.agent_metadata)
    return mgr


@settings(max_examples=40, deadline=None)
@given(kv=st.lists(st.tuples(ptr, st.integers(1, 2**30), st.sampled_from(["VRAM", "DRAM"])), min_size=1, max_size=6),
       aux=st.lists(ptr, max_size=3), state_ptrs=st.lists(st.lists(ptr, max_size=3), max_size=3),
       state_item_lens=nested, state_dims=nested, layer_ids=st.lists(small, max_size=4), state_layer_ids=nested,
       tp_rank=st.integers(0, 63), tp=st.integers(1, 64), gpu=st.integers(0, 7), slots=st.integers(1, 2**20),
       metadata=st.binary(max_size=64), port=st.integers(1, 65535))
def test_nixl_registrations_read_alike_both_ways(nixl_conn, kv, aux, state_ptrs, state_item_lens, state_dims,
                                                 layer_ids, state_layer_ids, tp_rank, tp, gpu, slots, metadata, port):
    state_lens = tuple(tuple(8 * (i + 1) for i in range(len(p))) for p in state_ptrs)
    reg = Registration("127.0.0.1", port, f"agent-{port}", tuple(p for p, _, _ in kv), tuple(n for _, n, _ in kv),
                       tuple(aux), tp_rank, tp, tuple(map(tuple, state_ptrs)), tuple(map(tuple, state_item_lens)),
                       tuple(map(tuple, state_dims)), tuple(layer_ids), tuple(map(tuple, state_layer_ids)),
                       agent_metadata=metadata, gpu_id=gpu, kv_mem_kinds=tuple(k for _, _, k in kv), num_slots=slots,
                       state_data_lens=state_lens)
    frames = registration_frames(reg, "nixl")
    assert frames[0] == b"NixlMsgGuard"
    theirs = nixl_conn.KVArgsRegisterInfo.from_zmq(frames[1:])  # SGLang's prefill strips the guard, then reads
    assert (theirs.endpoint, theirs.dst_port, theirs.agent_name, theirs.agent_metadata) == (
        reg.endpoint, port, reg.session_id, metadata)
    assert (theirs.dst_kv_ptrs, theirs.dst_aux_ptrs, theirs.dst_kv_item_lens, theirs.dst_kv_mem_kinds) == (
        list(reg.kv_ptrs), list(reg.aux_ptrs), list(reg.kv_item_lens), list(reg.kv_mem_kinds))
    assert (theirs.decode_tp_rank, theirs.decode_tp_size, theirs.gpu_id, theirs.dst_num_slots) == (tp_rank, tp, gpu, slots)
    assert theirs.dst_state_data_ptrs == [list(x) for x in reg.state_ptrs]
    assert theirs.dst_state_data_lens == [list(x) for x in state_lens]
    assert (theirs.dst_kv_layer_ids, theirs.dst_state_layer_ids) == (list(layer_ids), [list(x) for x in state_layer_ids])
    slot_bytes = [slots * n for n in reg.kv_item_lens]  # so that SGLang's num_kv_slots gives ``slots`` back
    mgr = nixl_decode(nixl_conn, replace(reg, num_slots=slots))
    mgr.kv_args.kv_data_lens = slot_bytes
    assert parse_registration(mgr.build_receiver_registration_message(), "nixl") == reg  # we read SGLang's


@settings(max_examples=60, deadline=None)
@given(room=st.integers(0, 2**63 - 1), pages=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=20),
       aux=st.integers(0, 2**20), state=st.lists(st.lists(st.integers(-2**31, 2**31 - 1), max_size=5), max_size=4),
       required=st.integers(1, 8), prefix=st.integers(0, 2**20), dummy=st.booleans())
def test_nixl_transfer_requests_read_alike_both_ways(nixl_conn, room, pages, aux, state, required, prefix, dummy):
    pages = np.array(pages, np.int32)
    req = TransferRequest(room, "127.0.0.1", 17000, "agent-a", pages if not dummy else np.zeros(0, np.int32),
                          None if dummy else aux, () if dummy else tuple(map(tuple, state)), required, prefix, dummy)
    theirs = nixl_conn.TransferInfo.from_zmq(transfer_frames(req, "nixl")[1:]) if not dummy else None
    if theirs is not None:  # (SGLang's reader takes a dummy's aux row as an integer it does not send)
        assert (theirs.room, theirs.is_dummy, theirs.required_dst_info_num, theirs.agent_name) == (
            room, False, required, "agent-a")
        assert theirs.dst_kv_indices.tolist() == pages.tolist() and theirs.dst_aux_index == aux
        assert theirs.dst_state_indices == [list(x) for x in req.state_lists]
        assert (theirs.decode_prefix_len or 0) == prefix
    mgr = nixl_decode(nixl_conn, Registration("127.0.0.1", 17000, "agent-a", (), (), (), 0, 1, num_slots=1))
    frames = mgr.build_receiver_metadata_message(bootstrap_room=room, required_dst_info_num=required, kv_indices=pages,
                                                 aux_index=aux, state_indices=[list(x) for x in state],
                                                 decode_prefix_len=prefix, is_dummy=dummy)
    ours = parse_transfer(frames, "nixl")
    assert (ours.room, ours.is_dummy, ours.required_dst_info_num, ours.decode_prefix_len, ours.session_id) == (
        room, dummy, required, prefix, "agent-a")
    assert ours.dst_pages.tolist() == ([] if dummy else pages.tolist())
    assert list(map(list, ours.state_lists)) == ([] if dummy else [list(x) for x in state])
    assert ours.aux_index == (None if dummy else aux)


def test_a_nixl_message_without_its_guard_or_with_bad_memory_kinds_is_refused():
    reg = Registration("127.0.0.1", 1, "agent", (4096,), (64,), (), 0, 1, kv_mem_kinds=("DRAM",), num_slots=4)
    frames = registration_frames(reg, "nixl")
    with pytest.raises(PeerError, match="no NixlMsgGuard frame first"):
        parse_registration(frames[1:], "nixl")
    with pytest.raises(PeerError, match="kv_mem_kinds"):
        parse_registration(frames[:18] + [b"HBM"] + frames[19:], "nixl")
    with pytest.raises(PeerError, match="no NixlMsgGuard frame first"):
        parse_transfer(transfer_frames(TransferRequest(1, "127.0.0.1", 1, "agent", np.array([3], np.int32), 0)), "nixl")
    with pytest.raises(ValueError, match="no SGLang framing for backend 'tcp'"):
        registration_frames(reg, "tcp")
