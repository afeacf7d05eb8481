"""A prefill endpoint's listening port: each decode endpoint that says hello gets a channel of its
own (kvplan/transport/listener.py), and a decode endpoint added later pairs or is left out whole."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq

from kvplan.errors import LayoutError
from kvplan.transport.control import ControlTimeout
from kvplan.transport.listener import ChannelListener, channel_via
from kvplan.transport.prefill import PrefillEndpoint
from tests.transport.fakes import FakeChannel, FakeEngine
from tests.transport.pairing import pair


def _listener() -> ChannelListener:
    return ChannelListener(0, host="127.0.0.1")  # an ephemeral port, bound at once


def test_each_hello_gets_a_channel_of_its_own_and_the_two_ends_talk():
    listener = _listener()
    try:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:  # two decode endpoints ask at once
            asked = [pool.submit(channel_via, "127.0.0.1", listener.port, 5.0) for _ in range(2)]
            deadline = time.monotonic() + 5
            made = []  # (a channel is ready once its decode has greeted it: the handshake's hello)
            while not all(f.done() for f in asked) and time.monotonic() < deadline:
                made.extend(listener.accept_pending())
            decodes = [f.result(timeout=5) for f in asked]

        def take():  # (the decodes' first messages wait for their channels' handshakes, answered as they are read)
            while len(made) < 2 and time.monotonic() < deadline:
                made.extend(listener.accept_pending())
            return {c.port: c.recv(time.monotonic() + 5)[1] for c in made}

        got = pair([lambda k=k, d=d: d.send("register", {"k": k}) for k, d in enumerate(decodes)], [take])[0]
        assert len(made) == 2 and len({c.port for c in made}) == 2
        assert got == {decode.port: {"k": k} for k, decode in enumerate(decodes)}
        for c in made + decodes:
            c.close()
    finally:
        listener.close()


def test_asking_a_port_where_nothing_listens_times_out():
    listener = _listener()
    port = listener.port
    listener.close()
    started = time.monotonic()
    with pytest.raises(ControlTimeout, match=r"listener on 127\.0\.0\.1"):
        channel_via("127.0.0.1", port, timeout=0.3)
    assert time.monotonic() - started < 2


def test_a_malformed_hello_gets_an_error_and_no_channel():
    listener = _listener()
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(f"tcp://127.0.0.1:{listener.port}")
        socket.send_multipart([b"not json"])
        deadline = time.monotonic() + 5
        made = []
        while not socket.poll(10) and time.monotonic() < deadline:
            made += listener.accept_pending()
        assert made == [] and json.loads(socket.recv_multipart()[-1]) == {"error": "expected a hello"}
    finally:
        socket.close()
        listener.close()


def test_a_hello_and_then_silence_costs_a_socket_for_a_bounded_time_and_never_blocks():
    """Every hello made a channel that was never closed, and pairing with it
    blocked the caller's loop for 5 s."""
    listener = ChannelListener(0, host="127.0.0.1", handshake_s=0.3, max_pending=2)
    sockets = []
    try:
        answers = []
        for _ in range(3):  # a peer that says hello three times, then nothing
            socket = zmq.Context.instance().socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(f"tcp://127.0.0.1:{listener.port}")
            socket.send_multipart([json.dumps({"kind": "hello"}).encode()])
            sockets.append(socket)
        deadline = time.monotonic() + 5
        while len(answers) < 3 and time.monotonic() < deadline:
            started = time.monotonic()
            assert listener.accept_pending() == []
            assert time.monotonic() - started < 0.1, "accept_pending blocked"
            answers += [json.loads(s.recv_multipart()[-1]) for s in sockets if s.poll(10)]
        # (the third hello is answered too: the oldest pending channel of its source gives way)
        assert sorted(map(sorted, answers)) == [["port"], ["port"], ["port"]]
        assert len(listener.pending) == 2 and listener.evicted == 1
        time.sleep(0.4)
        assert listener.accept_pending() == [] and listener.pending == []  # closed past their handshake
    finally:
        for socket in sockets:
            socket.close()
        listener.close()


def _endpoint():
    from tests.transport.test_layerwise import pools, side

    return PrefillEndpoint(side(pools(), {1: [5, 9]}), FakeEngine(), [])


def test_a_decode_endpoint_that_never_registers_is_left_out():
    endpoint = _endpoint()
    mine, _ = FakeChannel.pair()
    with pytest.raises(ControlTimeout):
        endpoint.add_peer(mine, timeout=0.1)
    assert endpoint.peers == []


def test_a_decode_endpoint_that_cannot_pair_is_refused_and_left_out():
    from kvplan.planner.contract.batch import KVLayout
    from kvplan.transport.registration import describe_side
    from tests.transport.test_layerwise import pools, side

    endpoint = _endpoint()
    mine, theirs = FakeChannel.pair()
    other = side(pools(), {1: [3, 4]})
    bad = type(other)(KVLayout(other.kv.attention, other.kv.page_size, other.kv.entries[:2]), other.state, other.aux,
                      other.req_to_token)  # one layer where this side has four
    theirs.send("register", {"side": describe_side(bad), "staging": None}, b"meta")
    with pytest.raises(LayoutError):
        endpoint.add_peer(mine, timeout=1)
    assert endpoint.peers == [] and theirs.try_recv()[0] == "refused"
    mine, theirs = FakeChannel.pair()
    theirs.send("register", {"side": describe_side(side(pools(), {1: [3, 4]})), "staging": None}, b"meta")
    assert endpoint.add_peer(mine, timeout=1) == 0 and endpoint.peers[0].side is not None


def _hellos_from(source: str, port: int, count: int) -> list:
    """``count`` DEALER sockets that each say hello to the listener on ``port`` from address ``source``."""
    sockets = []
    for _ in range(count):
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(f"tcp://{source}:0;127.0.0.1:{port}")
        socket.send_multipart([json.dumps({"kind": "hello"}).encode()])
        sockets.append(socket)
    return sockets


def _answers(listener, sockets, seconds=5.0) -> list[dict]:
    got, deadline = {}, time.monotonic() + seconds
    while len(got) < len(sockets) and time.monotonic() < deadline:
        listener.accept_pending()
        for k, s in enumerate(sockets):
            if k not in got and s.poll(5):
                got[k] = json.loads(s.recv_multipart()[-1])
    return [got.get(k) for k in range(len(sockets))]


def test_one_source_s_hellos_take_no_slot_of_another_source():
    """64 hellos every 4 s from one source made 7 of 10 legitimate pairings fail as "busy"
    (the listener's 64 slots were all that source's). A source now holds at most
    ``max_pending_per_source`` of them, its own oldest giving way (other loopback addresses stand for
    other hosts)."""
    listener = _listener()
    flood = _hellos_from("127.0.0.2", listener.port, 64)
    honest = []
    try:
        flooded = _answers(listener, flood)
        assert all("port" in a for a in flooded)
        assert len(listener.pending) == listener.max_pending_per_source and listener.evicted == 64 - 8
        honest = [s for k in range(10) for s in _hellos_from(f"127.0.1.{k + 1}", listener.port, 1)]  # ten hosts
        assert all("port" in a for a in _answers(listener, honest)), "an honest source was answered busy"
    finally:
        for s in flood + honest:
            s.close()
        listener.close()


def test_hellos_from_many_sources_that_fill_every_slot_leave_every_honest_pairing_whole():
    """Eight sources of eight silent hellos each (every one of the 64 slots) made 7 of 10 legitimate
    pairings fail as "busy". A hello now makes room (the oldest channel of the source that holds the most
    gives way): ten decodes pair one after another while the flood goes on."""
    listener = _listener()
    flood = [s for k in range(8) for s in _hellos_from(f"127.0.2.{k + 1}", listener.port, 8)]
    paired = []
    try:
        assert all("port" in a for a in _answers(listener, flood)) and len(listener.pending) == 64
        for k in range(10):
            flood += _hellos_from(f"127.0.2.{k % 8 + 1}", listener.port, 4)  # (the flood goes on between pairings)
            channel, ready = _ask(listener)
            paired.append(channel)
            with ThreadPoolExecutor(1) as pool:  # (the decode pairs and registers while the listener answers)
                sent = pool.submit(channel.send, "register", {"n": k}, timeout=5)
                deadline = time.monotonic() + 5
                while not ready and time.monotonic() < deadline:
                    ready += listener.accept_pending()
                    time.sleep(0.002)
                sent.result(timeout=5)
            assert ready, f"pairing {k} was never handed out"
            assert ready[-1].recv(time.monotonic() + 5)[:2] == ("register", {"n": k})
            ready[-1].close()
        assert len(listener.pending) <= listener.max_pending
    finally:
        for s in flood:
            s.close()
        for channel in paired:
            channel.close()
        listener.close()


def test_a_frame_above_a_hello_s_size_disconnects_its_sender_unread():
    """One 4 GB-scale frame from a stranger made a listener's process hold +2,304 MiB: the listening port took
    frames of any size. Now a frame above ``MAX_HELLO_BYTES`` drops the connection as it is announced
    (nothing is read into memory, nothing answered), and the next hello is answered as ever."""
    listener = _listener()
    big = zmq.Context.instance().socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.setsockopt(zmq.RECONNECT_IVL, 60_000)  # (one connection: dropped, not made again within the test)
    honest = []
    try:
        big.connect(f"tcp://127.0.0.1:{listener.port}")
        big.send(b"x" * (16 << 20), copy=False)
        assert _answers(listener, [big], seconds=1.5) == [None]
        honest = _hellos_from("127.0.0.1", listener.port, 1)
        assert "port" in _answers(listener, honest)[0]
    finally:
        for s in [big, *honest]:
            s.close()
        listener.close()


def test_connections_that_say_nothing_are_ended_within_the_handshake_time_and_a_bounded_count():
    """2,000 idle connections held 2,006 descriptors 13 s after they were made: ZeroMQ keeps a connection
    for ever. A listener's connection now lives ``handshake_s`` at most, and beyond ``max_connections``
    open at once the oldest go first; raw TCP connects that never speak ZeroMQ are closed as well."""
    import socket

    listener = ChannelListener(0, host="127.0.0.1", handshake_s=0.5, max_connections=8)
    quiet = [zmq.Context.instance().socket(zmq.DEALER) for _ in range(20)]
    raw = []
    try:
        for s in quiet:
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RECONNECT_IVL, 60_000)
            s.connect(f"tcp://127.0.0.1:{listener.port}")
        raw = [socket.create_connection(("127.0.0.1", listener.port), timeout=5) for _ in range(20)]
        deadline, most = time.monotonic() + 1.0, 0
        while time.monotonic() < deadline:  # (within the handshake time: the count bound)
            listener.accept_pending()
            most = max(most, len(listener.connections))
            time.sleep(0.02)
        assert 0 < most <= 8 + 40 and len(listener.connections) <= 8, most  # (a step ends what is over the count)
        deadline = time.monotonic() + 5
        while (len(listener.connections) or listener.connections.ended < 20) and time.monotonic() < deadline:
            listener.accept_pending()
            time.sleep(0.05)
        assert len(listener.connections) == 0 and listener.connections.ended >= 20
        for connection in raw:  # (closed at the other end: ZeroMQ's greeting, then the end of the stream)
            connection.settimeout(5)
            try:
                while connection.recv(1024):
                    pass
            except ConnectionResetError:
                pass
    finally:
        for s in quiet:
            s.close()
        for connection in raw:
            connection.close()
        listener.close()


def _ask(listener, secret=None):
    """A decode's channel from ``listener`` (channel_via on a thread while the listener answers here), and
    what accept_pending handed out meanwhile."""
    from concurrent.futures import ThreadPoolExecutor

    ready = []
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(channel_via, "127.0.0.1", listener.port, 5.0, secret=secret)
        while not asked.done():
            ready += listener.accept_pending()
            time.sleep(0.002)
        return asked.result(), ready


def test_a_channel_whose_peer_cannot_prove_the_secret_is_never_handed_out_and_is_closed():
    """A channel was handed to the prefill as soon as anything arrived on it, so a process without
    the secret became a pairing peer. Now a channel is ready only once its peer has paired (the secret
    proved) and sent; the stranger's is closed at the handshake deadline, the honest one is handed out."""
    from concurrent.futures import ThreadPoolExecutor

    listener = ChannelListener(0, host="127.0.0.1", handshake_s=1.0, secret=b"the deployment's")
    stranger, _ = _ask(listener, secret=b"a guess")
    honest, _ = _ask(listener, secret=b"the deployment's")
    try:
        with ThreadPoolExecutor(2) as pool:
            tries = [pool.submit(c.send, "register", {"who": c.port}, timeout=2.0) for c in (stranger, honest)]
            ready, deadline = [], time.monotonic() + 3
            while time.monotonic() < deadline and (not ready or listener.pending):
                ready += listener.accept_pending()
                time.sleep(0.01)
            tries[1].result(timeout=5)
            try:  # (the stranger's send may leave: it is never taken)
                tries[0].result(timeout=5)
            except ControlTimeout:
                pass
        assert len(ready) == 1 and listener.pending == []
        assert ready[0].recv(time.monotonic() + 1) == ("register", {"who": honest.port}, [])
        assert ready[0].peer_incarnation is not None
    finally:
        for c in (stranger, honest):
            c.close()
        listener.close()


def test_a_listener_s_decode_that_goes_has_its_channel_closed_and_the_bound_on_peers_holds():
    """Decodes that registered through the listener and left kept their channels open (+803
    descriptors per 200) until the process hit ZeroMQ's socket cap and no decode could pair again. A gone
    peer's channel is now closed with what it published; at most ``max_peers`` are paired or pairing."""
    from kvplan.errors import PeerError
    from kvplan.transport.registration import describe_side
    from tests.transport.test_layerwise import pools, side

    endpoint = PrefillEndpoint(side(pools(), {1: [5, 9]}), FakeEngine(), [], max_peers=1)
    listener = _listener()
    layout = {"side": describe_side(side(pools(), {1: [3, 4]})), "staging": None}

    def take(ready):
        deadline = time.monotonic() + 5
        while not ready and time.monotonic() < deadline:
            ready += listener.accept_pending()
            time.sleep(0.005)
        assert ready, "no channel became ready"
        return endpoint.add_peer(ready[0], timeout=5)

    decode, ready = _ask(listener)
    second = None
    try:
        assert pair([lambda: decode.send("register", layout, b"meta")], [lambda: take(ready)]) == [0]
        second, ready = _ask(listener)
        with pytest.raises(PeerError, match="max_peers"):
            pair([lambda: second.send("register", layout, b"meta")], [lambda: take(ready)])
        channel = endpoint.peers[0].channel
        decode.close()  # the decode goes
        deadline = time.monotonic() + 5
        while not endpoint.peers[0].dropped:
            assert time.monotonic() < deadline, "the gone decode was never dropped"
            endpoint.progress()
            time.sleep(0.01)
        assert channel.closed and endpoint.progress() == [] and len(endpoint.peers) == 1
    finally:
        for c in (decode, second):
            if c is not None:
                c.close()
        listener.close()


def test_a_channel_that_cannot_be_opened_answers_busy_and_the_listener_lives_on(monkeypatch):
    """At ZeroMQ's socket cap the listener raised ZMQError from accept_pending, and no decode could
    pair again. A hello that cannot get a channel is answered "busy"; the next one, once sockets are
    free, gets its channel."""
    import kvplan.transport.listener as listener_module

    listener = _listener()
    real = listener_module.ControlChannel
    monkeypatch.setattr(listener_module, "ControlChannel",
                        lambda *a, **k: (_ for _ in ()).throw(zmq.ZMQError(24, "Too many open files")))
    sockets = _hellos_from("127.0.0.1", listener.port, 1)
    try:
        (answer,) = _answers(listener, sockets)
        assert "busy" in answer["error"] and "no channel could be opened" in answer["error"], answer
        monkeypatch.setattr(listener_module, "ControlChannel", real)
        sockets += _hellos_from("127.0.0.1", listener.port, 1)
        assert "port" in _answers(listener, sockets[1:])[0]
    finally:
        for s in sockets:
            s.close()
        listener.close()


def test_a_port_that_is_taken_is_named_in_one_error_of_kvplan_s():
    from kvplan.transport.listener import AddressInUse

    first = _listener()
    try:
        with pytest.raises(AddressInUse, match=f"^127.0.0.1:{first.port} is taken: another process listens there"):
            ChannelListener(first.port, host="127.0.0.1")
    finally:
        first.socket.close(0)
