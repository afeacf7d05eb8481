"""The control channel's handshake and message codes (kvplan/transport/auth.py, control.py): a
channel pairs with one incarnation, only a peer holding the same secret pairs, and a message from any other
incarnation, a replayed one or a tampered one is refused, never returned."""

import json
import time

import pytest

from kvplan.transport.auth import INCARNATION, secret_from_environment
from kvplan.transport.control import MARK, ControlChannel
from kvplan.transport.control_wire import SecretMismatch
from tests.transport.test_control import _first


def _channels(bound_secret=b"s3cret", peer_secret=b"s3cret"):
    """Two ends on loopback; ``None``: that end runs open (the explicit opt-out: given nothing, it would
    prove the loopback secret)."""
    bound = ControlChannel(host="127.0.0.1", secret=bound_secret, insecure=bound_secret is None, peer_timeout=30)
    peer = ControlChannel(bound.port, host="127.0.0.1", secret=peer_secret, insecure=peer_secret is None,
                          peer_timeout=30)
    return bound, peer


def _recorded(channel):
    """Every message ``channel`` sends, as its wire parts."""
    real, sent = channel.socket.send_multipart, []

    def send_multipart(parts, flags=0):
        sent.append(list(parts))
        return real(parts, flags)

    channel.socket.send_multipart = send_multipart
    return sent


def _nothing(channel, seconds=0.3):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert channel.try_recv() is None
        time.sleep(0.01)


def test_two_ends_with_the_same_secret_pair_and_name_each_other_s_incarnation():
    bound, peer = _channels()
    try:
        assert _first(peer, bound, "lists", {"n": 1})[:2] == ("lists", {"n": 1})
        assert bound.peer_incarnation == INCARNATION  # (the peer has proved the secret)
        bound.send("request", {"n": 2}, timeout=5)
        assert peer.recv(time.monotonic() + 5)[:2] == ("request", {"n": 2})
        assert peer.peer_incarnation == INCARNATION  # (once it has read the other end's proof)
    finally:
        bound.close()
        peer.close()


@pytest.mark.parametrize("peer_secret, why, bound_why", [(b"another", "secret mismatch", "secret mismatch"),
                                                          (None, "peer requires a secret", "peer has no secret")])
def test_a_peer_without_the_secret_never_pairs_and_each_end_names_why(peer_secret, why, bound_why, monkeypatch):
    """Neither end takes the other's messages, and neither sends any: the connecting end names why as soon
    as the bound end's hello (its secret flag) or proof shows it, the bound end when its wait ends."""
    monkeypatch.delenv("KVPLAN_SECRET", raising=False)
    bound, peer = _channels(peer_secret=peer_secret)
    try:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            sent = pool.submit(peer.send, "register", {}, timeout=5)
            _nothing(bound, 1.0)
            with pytest.raises(SecretMismatch, match=f"^{why}: .*KVPLAN_SECRET"):
                sent.result(timeout=5)
            assert time.monotonic() - started < 2.0  # (named at once, not at the 5 s deadline)
        with pytest.raises(SecretMismatch, match=f"^{bound_why}: "):
            bound.send("request", {"n": 1}, timeout=1)  # (a bound end sends only to a peer that proved it)
        _nothing(peer, 0.5)
        assert bound.peer_incarnation is None and peer.peer_incarnation is None
        assert bound.refused == 1  # its proof or its hello, once
        assert peer.refused >= 1  # the other end's proof or hello
    finally:
        bound.close()
        peer.close()


def test_a_peer_with_a_secret_is_named_by_an_end_without_one(monkeypatch):
    monkeypatch.delenv("KVPLAN_SECRET", raising=False)
    bound, peer = _channels(bound_secret=None, peer_secret=b"s3cret")
    try:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(peer.send, "register", {}, timeout=5)
            _nothing(bound, 1.0)  # (the bound end's owner reads: it answers the hello with its own)
            with pytest.raises(SecretMismatch, match="^peer has no secret: "):
                sent.result(timeout=5)
        with pytest.raises(SecretMismatch, match="^peer requires a secret: "):
            bound.send("request", {}, timeout=1)
        assert bound.peer_incarnation is None
    finally:
        bound.close()
        peer.close()


def test_a_replayed_message_and_a_tampered_one_are_refused():
    bound, peer = _channels()
    try:
        _first(peer, bound)
        sent = _recorded(peer)
        peer.send("failed", {"request": "r1", "reason": "x"}, timeout=5)
        assert bound.recv(time.monotonic() + 5)[1]["request"] == "r1"
        peer.socket.send_multipart(sent[-1])  # the same message again: a replay
        tampered = list(sent[-1])
        envelope = json.loads(tampered[1])
        tampered[1] = json.dumps({**envelope, "s": envelope["s"] + 5}).encode()  # a later number, the old code
        peer.socket.send_multipart(tampered)
        changed = list(sent[-1])
        changed[1] = json.dumps({**envelope, "s": envelope["s"] + 6}).encode()
        changed[4] = json.dumps({"request": "r2", "reason": "x"}).encode()
        peer.socket.send_multipart(changed)
        _nothing(bound)
        assert bound.refused >= 3
        peer.send("failed", {"request": "r3"}, timeout=5)  # the pairing goes on
        assert bound.recv(time.monotonic() + 5)[1]["request"] == "r3"
    finally:
        bound.close()
        peer.close()


def test_a_message_from_another_incarnation_is_refused_without_a_secret(monkeypatch):
    """Run open anyone can pair, but a channel stays bound to the incarnation it paired with: a
    message naming another sender is refused."""
    monkeypatch.delenv("KVPLAN_SECRET", raising=False)
    bound, peer = _channels(None, None)
    try:
        _first(peer, bound)
        envelope = json.dumps({"f": "0123456789abcdef", "t": INCARNATION, "s": 10**6}).encode()
        peer.socket.send_multipart([MARK, envelope, b"", b"failed", json.dumps({"request": "r1"}).encode()])
        peer.socket.send_multipart([b"failed", b"{}"])  # not this protocol at all
        _nothing(bound)
        assert bound.refused == 2
    finally:
        bound.close()
        peer.close()


def test_the_secret_comes_from_the_environment_or_a_file_and_is_never_empty(tmp_path, monkeypatch):
    monkeypatch.delenv("KVPLAN_SECRET", raising=False)
    monkeypatch.delenv("KVPLAN_SECRET_FILE", raising=False)
    assert secret_from_environment() is None
    path = tmp_path / "secret"
    path.write_text("from-a-file\n")
    path.chmod(0o600)  # (a secret's file is its owner's alone)
    monkeypatch.setenv("KVPLAN_SECRET_FILE", str(path))
    assert secret_from_environment() == b"from-a-file"
    monkeypatch.setenv("KVPLAN_SECRET", "  ")
    with pytest.raises(ValueError, match="empty"):
        secret_from_environment()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_secret_file_others_may_read_or_write_is_refused_naming_the_fix(tmp_path, monkeypatch, mode):
    from kvplan.env import SettingError, validate
    from kvplan.transport.auth import secret_from_file

    path = tmp_path / "secret"
    path.write_text("s3cret\n")
    path.chmod(mode)
    with pytest.raises(ValueError, match=f"not private to this user: its mode {mode:o} .*chmod 600"):
        secret_from_file(str(path))
    with pytest.raises(SettingError, match="KVPLAN_SECRET_FILE.*chmod 600"):  # (at start, with the other settings)
        validate({"KVPLAN_SECRET_FILE": str(path)})
    path.chmod(0o400)
    assert secret_from_file(str(path)) == b"s3cret"


def test_fuzzed_envelopes_and_codes_on_a_paired_channel_are_refused_never_returned_never_raised():
    """The hostile-peer fuzzer over incarnations and codes. On a channel paired with a
    secret, a real message of the peer is altered in one place (any byte of any frame, the sequence
    number, either incarnation, the code) or replaced by random frames; each such message is refused
    (counted, never returned, never raised from the reading loop), and the unaltered message still
    comes through afterwards (the refusals changed nothing of the pairing)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    bound, peer = _channels()
    try:
        _first(peer, bound)
        sent = _recorded(peer)
        peer.send("failed", {"request": "r1", "reason": "x"}, b"\x00\x01frame", timeout=5)
        original = sent[-1]
        bound.socket.recv_multipart()  # (read off the socket: the fuzzed copies go to _take, one by one, as the peer's)

        def altered(parts, frame, at, value):
            parts = [bytes(p) for p in parts]
            frame %= len(parts)
            if not parts[frame]:
                parts[frame] = bytes([value])
            else:
                body = bytearray(parts[frame])
                at %= len(body)
                body[at] = (body[at] + 1 + value % 255) % 256  # (a different byte, always)
                parts[frame] = bytes(body)
            return parts

        envelope = json.loads(original[1])
        mutations = st.one_of(
            st.builds(altered, st.just(original), st.integers(0, 10), st.integers(0, 1 << 16), st.integers(0, 255)),
            st.builds(lambda seq: [original[0], json.dumps({**envelope, "s": seq}).encode(), *original[2:]],
                      st.one_of(st.integers(-5, envelope["s"] - 1), st.integers(envelope["s"] + 1, 1 << 70),
                                st.text(max_size=3), st.none(), st.floats())),
            st.builds(lambda key, who: [original[0], json.dumps({**envelope, key: who}).encode(), *original[2:]],
                      st.sampled_from(["f", "t"]), st.one_of(st.text(max_size=16), st.integers(), st.none())),
            st.lists(st.binary(max_size=40), max_size=7))

        @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(mutations)
        def refused(parts):
            if parts == original:
                return
            before = bound.refused
            assert bound._take(bound._peer_rid, bound._peer_fd, parts) is None, parts
            assert bound.refused == before + 1 or parts[3:4] in ([b"_hello"], [b"_proof"]), parts

        refused()
        assert bound._take(bound._peer_rid, bound._peer_fd, original)[:2] == ("failed", {"request": "r1", "reason": "x"})  # (its sequence number is next)
    finally:
        bound.close()
        peer.close()


def _raw(port):
    """A raw ZeroMQ connection to a bound channel: what a stranger on the host can send."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _say(sock, sender, kind, header, receiver=""):
    envelope = json.dumps({"f": sender, "t": receiver, "s": 0}).encode()
    sock.send_multipart([MARK, envelope, b"", kind.encode(), json.dumps(header).encode()])


def _heard(sock, bound, seconds=1.0):
    """What ``bound`` sends ``sock`` within ``seconds`` (``bound`` read meanwhile): (kind, header) each."""
    import zmq

    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        assert bound.try_recv() is None
        while sock.poll(0, zmq.POLLIN):
            parts = sock.recv_multipart()
            out.append((parts[3].decode(), json.loads(parts[4])))
        time.sleep(0.01)
    return out


def test_a_stranger_cannot_pair_by_reflecting_the_bound_end_s_own_proof():
    """With a secret, a stranger says hello as anyone and learns the bound end's nonce; then says hello again as
    the bound end's own incarnation with that nonce, and sends back as its own the proof the bound end answers.
    A proof names the prover's role and both nonces, and a hello with this side's own nonce is refused: the
    stranger never becomes the peer, and hears nothing past the handshake."""
    bound = ControlChannel(host="127.0.0.1", secret=b"s3cret", peer_timeout=30)
    first, second = _raw(bound.port), _raw(bound.port)
    try:
        _say(first, "0123456789abcdef", "_hello", {"nonce": "n" * 32, "secret": True})
        hello = [h for k, h in _heard(first, bound) if k == "_hello"]
        assert hello, "the bound end answers a hello with its own"
        its_nonce = hello[0]["nonce"]
        _say(second, INCARNATION, "_hello", {"nonce": its_nonce, "secret": True})  # (the bound end is this process)
        answered = _heard(second, bound)
        for kind, header in answered:  # whatever proof it answered, sent back as the stranger's own
            if kind == "_proof":
                _say(second, INCARNATION, "_proof", header, receiver=INCARNATION)
        _heard(second, bound, 0.5)
        assert bound.peer_incarnation is None and not bound._authed
        with pytest.raises(Exception):
            bound.send("registration", {"pools": "secret"}, timeout=0.3)
        assert not [k for k, _ in _heard(second, bound, 0.3) if not k.startswith("_")]
    finally:
        first.close()
        second.close()
        bound.close()


def test_a_stranger_on_the_port_a_connecting_end_dials_cannot_pair_by_reflecting_its_proof():
    """The other topology (a decode that connects, as the integrations' do): a stranger listens where the
    connecting end dials, answers its hello with a hello in its own incarnation and nonce, and sends back as
    its own proof whatever proof the connecting end answers. It never pairs, and hears nothing but the
    handshake."""
    import zmq

    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    peer = ControlChannel(port, host="127.0.0.1", secret=b"s3cret", peer_timeout=30)
    heard = []
    try:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            assert peer.try_recv() is None
            while router.poll(0, zmq.POLLIN):
                rid, _, envelope, _, kind, header = router.recv_multipart()[:6]
                kind, header, sender = kind.decode(), json.loads(header), json.loads(envelope)["f"]
                heard.append(kind)
                reply = {"_hello": ("_hello", {"nonce": header.get("nonce"), "secret": True}),
                         "_proof": ("_proof", header)}.get(kind)  # (its own hello, its own proof, sent back)
                if reply is not None:
                    back = json.dumps({"f": sender, "t": sender, "s": 0}).encode()
                    router.send_multipart([rid, MARK, back, b"", reply[0].encode(), json.dumps(reply[1]).encode()])
            time.sleep(0.01)
        assert peer.peer_incarnation is None and not peer._authed
        assert heard and set(heard) <= {"_hello", "_proof"}, heard
    finally:
        peer.close()
        router.close()


def test_a_forked_child_is_an_incarnation_of_its_own():
    """Processes forked from one kvplan process are different peers: a sibling's "writes ended" or sealed
    note must not pass for another's. Each child gets an incarnation at the fork."""
    import multiprocessing

    from kvplan.transport import auth

    context = multiprocessing.get_context("fork")
    mine, theirs = context.Pipe()
    children = [context.Process(target=lambda: theirs.send(auth.INCARNATION)) for _ in range(2)]
    for child in children:
        child.start()
    seen = {mine.recv() for _ in children}
    for child in children:
        child.join(10)
    assert len(seen) == 2 and auth.INCARNATION not in seen
    channel = ControlChannel(host="127.0.0.1")
    try:
        assert channel.incarnation == auth.INCARNATION  # (a channel is its maker's)
    finally:
        channel.close()
