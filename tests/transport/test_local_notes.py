"""The ipc engine's notification box takes a datagram's sender from the kernel (kvplan/transport/engines/
local_notes.py): a process it did not admit cannot complete a request by naming a peer's engine, another
user's datagrams are dropped, and what waits for an admission is bounded."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from kvplan.transport.engines import local_notes
from kvplan.transport.engines.local_notes import NoteBox


def _send_as(name: str, address: bytes, messages: list[bytes], uid: int | None = None) -> None:
    if uid is not None:
        os.setuid(uid)
    box = NoteBox(name)
    for message in messages:
        box.send(address, message)
    box.close()


def _child(name: str, address: bytes, messages: list[bytes], uid: int | None = None) -> int:
    """Send ``messages`` as the engine ``name`` from a process of its own; its pid once it has ended."""
    child = multiprocessing.get_context("fork").Process(target=_send_as, args=(name, address, messages, uid))
    child.start()
    child.join(30)
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0
    return child.pid


def _received(box: NoteBox, wanted: int = 0, seconds: float = 2.0) -> list:
    got, deadline = box.receive(), time.monotonic() + seconds
    while len(got) < wanted and time.monotonic() < deadline:
        time.sleep(0.01)
        got += box.receive()
    return got


def test_a_process_that_was_not_admitted_is_not_heard_under_any_name():
    """A stranger naming the peer's engine completed a request whose bytes were never written (without a
    secret). Its datagrams now wait for an admission of its own pid, which never comes."""
    box = NoteBox("decode")
    try:
        peer = _child("prefill-0", box.address, [b"section 1"])
        box.admit(peer, "prefill-0")
        assert _received(box, 1) == [("prefill-0", b"section 1")]
        _child("prefill-0", box.address, [b"forged: section 2"])  # (the peer's name, another process)
        assert _received(box, seconds=0.3) == []
    finally:
        box.close()


def test_a_peer_s_notes_that_come_before_its_admission_are_handed_out_once_it_is_admitted():
    box = NoteBox("decode")
    try:
        peer = _child("prefill-0", box.address, [b"early 1", b"early 2"])
        assert _received(box, seconds=0.3) == []
        box.admit(peer, "prefill-0")
        assert _received(box, 2) == [("prefill-0", b"early 1"), ("prefill-0", b"early 2")]
        box.forget(peer, "prefill-0")
        assert box.receive() == []
    finally:
        box.close()


def test_an_admitted_process_is_heard_only_under_the_name_it_registered():
    box = NoteBox("decode")
    try:
        peer = _child("prefill-1", box.address, [b"as another engine"])
        box.admit(peer, "prefill-0")
        assert _received(box, seconds=0.3) == []
    finally:
        box.close()


def test_what_waits_for_an_admission_is_bounded_and_the_excess_counted(monkeypatch):
    monkeypatch.setattr(local_notes, "UNCLAIMED", 8)
    box = NoteBox("decode")
    try:
        for round_ in range(4):  # (a few at a time: the kernel queues ~10 datagrams a socket)
            _child("stranger", box.address, [b"%d" % (5 * round_ + k) for k in range(5)])
            assert box.receive() == []
        assert len(box._unclaimed) == 8 and box.refused == 12
    finally:
        box.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="sending as another user needs root here")
def test_another_user_s_datagrams_are_dropped_even_under_an_admitted_pid_s_name():
    box = NoteBox("decode")
    try:
        stranger = _child("prefill-0", box.address, [b"from nobody"], uid=65534)
        box.admit(stranger, "prefill-0")
        assert _received(box, seconds=0.3) == [] and box.refused == 1
    finally:
        box.close()
