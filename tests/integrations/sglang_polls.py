"""Polling an adapter's senders as SGLang's scheduler does, turn after turn, until each concludes: a
prefill manager moves its batches on its progress thread, so one ``poll`` may still say Transferring."""

from __future__ import annotations

import time
from typing import Any

WAIT_S = 30.0  # the most a test waits (a loaded 2-core machine); a pass concludes within milliseconds


def concluded(sender: Any, kv_poll: Any, wait_s: float = WAIT_S) -> int:
    """``sender.poll()`` until Success or Failed (raising past ``wait_s``); the state."""
    deadline = time.monotonic() + wait_s
    while (state := sender.poll()) not in (kv_poll.Success, kv_poll.Failed):
        assert time.monotonic() < deadline, f"request {sender.room} never concluded (state {state})"
        time.sleep(0.001)
    return state


def poll_until_concluded(senders: dict, kv_poll: Any, wait_s: float = WAIT_S) -> dict:
    """Every sender of ``{room: sender}`` polled until it concludes; ``{room: state}``."""
    return {room: concluded(sender, kv_poll, wait_s) for room, sender in senders.items()}


def until(condition, wait_s: float = WAIT_S) -> None:
    """Wait (raising past ``wait_s``) until ``condition()`` holds: what a progress thread does next."""
    deadline = time.monotonic() + wait_s
    while not condition():
        assert time.monotonic() < deadline, "the progress thread never got there"
        time.sleep(0.001)
