"""A prefill SIGSTOPped in the middle of a 256 MiB write was taken for a dead one (the
decode's ``fenced()`` was true after about 1 s) and after the resume 115.8 MiB (NIXL) and 235.9 MiB
(Mooncake) landed in pages declared reusable. A sender lost to its silence no longer fences its requests:
only its word does (it pairs again, the same process, and says its writes ended), or its process ending.
The sender runs in a child process that is stopped, resumed or killed by its own handle."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from kvplan.planner.device.destinations import PreallocatedRequest
from kvplan.transport.control import ControlChannel, ControlTimeout
from kvplan.transport.decode import DecodeEndpoint
from kvplan.tools.target_process import child_process
from tests.transport.fakes import FakeEngine
from tests.transport.test_restart import PAGE_BYTES, side

# the endpoints plan on CPU tables: through Triton's interpreter (make test's pass; a GPU run skips them)
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "0", reason="CPU tables need the interpreter")


def _sender(port: int, seconds: float) -> None:
    """A prefill endpoint paired with the decode on ``port``, reading its channel for ``seconds``."""
    from kvplan.transport.prefill import PrefillEndpoint

    pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    prefill = PrefillEndpoint(side(pool, {1: [5, 9]}), FakeEngine(), ControlChannel(port, host="127.0.0.1"))
    prefill.accept(timeout=10)
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # (registrations again after a loss are read here)
        prefill.progress()
        time.sleep(0.005)


def _paired_decode(seconds: float):
    pool = torch.zeros(16 * PAGE_BYTES, dtype=torch.uint8)
    decode = DecodeEndpoint(side(pool, {1: [3, 4]}), FakeEngine(), ControlChannel(host="127.0.0.1"))
    sender = child_process(_sender, decode.channel.port, seconds)
    sender.start()
    deadline = time.monotonic() + 90  # (a worker's first child waits for its fork server to import)
    while True:
        try:
            decode.register(timeout=2)
            break
        except ControlTimeout:  # (nothing of the registration left: its handshake had not ended)
            assert sender.is_alive(), f"the sender process ended with code {sender.exitcode} before it paired"
            assert time.monotonic() < deadline, "the sender never paired"
    decode.publish([PreallocatedRequest("r1", 1, 8)], timeout=5)
    return decode, sender


def _until(predicate, decode, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, what
        decode.poll()
        time.sleep(0.01)


def _end(sender) -> None:
    if sender.is_alive():
        os.kill(sender.pid, signal.SIGCONT)
        sender.kill()
    sender.join(timeout=10)


def test_a_stopped_sender_fences_nothing_until_it_resumes_and_says_its_writes_ended():
    decode, sender = _paired_decode(seconds=60)
    try:
        os.kill(sender.pid, signal.SIGSTOP)
        _until(lambda: decode.tracker.state("r1") == "failed", decode, 15, "the stopped sender was never seen gone")
        assert decode.channel.lost_by == "silence"
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            decode.poll()
            assert not decode.fenced("r1"), "a stopped sender's request was fenced: its writes may still land"
            time.sleep(0.01)
        os.kill(sender.pid, signal.SIGCONT)  # it resumes: pairs again, with nothing of its writes left
        _until(lambda: decode.fenced("r1"), decode, 20, "the resumed sender's word never fenced the request")
    finally:
        _end(sender)
        decode.channel.close()


def test_a_sender_whose_process_ends_fences_its_requests():
    decode, sender = _paired_decode(seconds=60)
    try:
        sender.kill()
        sender.join(timeout=10)
        _until(lambda: decode.tracker.state("r1") == "failed", decode, 15, "the dead sender was never seen gone")
        assert decode.channel.lost_by == "closed"
        decode.abort("r1", "the caller gives up")
        _until(lambda: decode.fenced("r1"), decode, 5, "a dead sender's request was never fenced")
    finally:
        _end(sender)
        decode.channel.close()
