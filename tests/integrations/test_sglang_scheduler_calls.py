"""What SGLang 0.5.23's schedulers call on a manager, sender and receiver, with SGLang's meaning.

The list of calls is docs/sglang.md §"What SGLang's schedulers call"; a test scans SGLang's own
scheduler sources and fails on a call the list does not name, and on a name the list says kvplan has
that its classes lack. The others drive the calls on kvplan's classes: the decode prefix SGLang's
prefill reads with ``pop_decode_prefix_len``, aborts on either side (the peer is told), ``clear``,
the transfer metric, the receiver's state flags, and a receiver whose prefill cannot be found.
"""

import ast
import dataclasses
import re
import types
from pathlib import Path

import numpy as np
import torch
import pytest

from tests.integrations import sglang_sides
from tests.integrations.sglang_polls import concluded, until
from tests.integrations.test_sglang_adapter import _free_managers, _manager, free_port  # noqa: F401 (fixture)
from tests.sglang_real import sglang_module

pytestmark = [pytest.mark.sglang, pytest.mark.engines]


@pytest.fixture(autouse=True)
def _sglang_first():
    """SGLang imported the tests' way (tests.sglang_real: skipped where it is not installed) before a test
    imports the adapter: imported first by the adapter, it fails on a module this machine lacks
    (torchvision), as these tests did when one of them was the first a worker ran."""
    sglang_module("srt.disaggregation.base.conn")
DOC = Path(__file__).resolve().parents[2] / "docs" / "sglang.md"
# the scheduler sources named below, and the names they give a manager, sender or receiver
SOURCES = ("disaggregation/prefill.py", "disaggregation/decode.py", "disaggregation/decode_schedule_batch_mixin.py",
           "disaggregation/utils.py", "managers/scheduler.py", "managers/disagg_service.py",
           "managers/scheduler_pp_mixin.py", "managers/schedule_batch.py")
HOLDERS = {"kv_manager": "manager", "kv_mgr": "manager", "disagg_kv_sender": "sender", "kv_sender": "sender",
           "sender": "sender", "kv_receiver": "receiver", "receiver": "receiver"}


def _sglang_calls() -> set[tuple[str, str]]:
    """``(role, attribute)`` for every attribute SGLang's scheduler code reads or calls on an object it
    holds as a manager, sender or receiver (``x.kv_manager.attr``, ``getattr(x.kv_receiver, "attr")``)."""
    root = Path(sglang_module("srt.disaggregation.utils").__file__).parents[1]
    found = set()
    for source in SOURCES:
        tree = ast.parse((root / source).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and not node.attr.startswith("__"):
                holder = node.value
                name = holder.attr if isinstance(holder, ast.Attribute) else getattr(holder, "id", None)
                if name in HOLDERS:
                    found.add((HOLDERS[name], node.attr))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr") \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                holder = node.args[0]
                name = holder.attr if isinstance(holder, ast.Attribute) else getattr(holder, "id", None)
                if name in HOLDERS:
                    found.add((HOLDERS[name], str(node.args[1].value)))
    return found


def _documented() -> dict[tuple[str, str], str]:
    """``(role, attribute) -> support`` from the table in docs/sglang.md."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\|\s*(manager|sender|receiver)\s*\|\s*`(\w+)`\s*\|[^|]*\|\s*(\w+)", line)
        if m:
            rows[(m.group(1), m.group(2))] = m.group(3)
    return rows


def test_every_call_of_sglang_s_schedulers_is_in_the_list():
    calls, documented = _sglang_calls(), _documented()
    missing = sorted(calls - set(documented))
    assert not missing, f"SGLang's schedulers call these; docs/sglang.md does not list them: {missing}"
    assert len(calls) > 30  # the scan found SGLang's calls (it would pass vacuously on an empty scan)


def test_what_the_list_says_kvplan_has_its_classes_have():
    sglang_module("srt.disaggregation.base.conn")  # (SGLang's import chain, or a skip)
    from kvplan.integrations.sglang import adapter

    classes = {"manager": adapter.KVManager, "sender": adapter.KVSender, "receiver": adapter.KVReceiver}
    instance_attrs = {("sender", "kv_mgr"), ("receiver", "kv_mgr"), ("receiver", "abort_notified"),
                      ("receiver", "bootstrap_infos"), ("manager", "kv_args"), ("manager", "prefill_info_table"),
                      ("manager", "server_args")}  # set in __init__ (checked on instances elsewhere)
    for (role, name), support in _documented().items():
        if support in ("yes", "inherited") and (role, name) not in instance_attrs:
            assert hasattr(classes[role], name), f"docs/sglang.md says the {role} has {name}"
        if support == "no":  # kvplan does not define what it says it does not support (its role halves included)
            ours = [c for c in classes[role].__mro__ if c.__module__.startswith("kvplan.")]
            assert not any(name in vars(c) for c in ours), f"docs/sglang.md says the {role} has no {name}"


def _prefill_with_decode(room_prefix: dict[int, int]):
    """A prefill manager with one decode side on an in-memory channel that published ``room -> prefix``."""
    base = sglang_module("srt.disaggregation.base.conn")
    from kvplan.planner.contract.plan import DestinationLists
    from kvplan.transport.prefill import Peer
    from tests.transport.fakes import FakeChannel

    kv, aux = sglang_sides.pools(1)
    mgr = _manager(sglang_sides.kv_args_of(base, kv, aux), "PREFILL", max_running_requests=4, context_length=64)
    ours, theirs = FakeChannel.pair()
    mgr.prefill.peers.append(Peer(ours))
    for room, prefix in room_prefix.items():
        mgr.prefill.peers[0].lists[room] = (DestinationLists(np.array([3, 4]), ()), 0, prefix)
    return base, mgr, theirs


def test_the_prefill_reads_the_decode_s_cached_prefix():
    """SGLang's prefill starts sending at ``pop_decode_prefix_len()`` and counts only the pages after it
    (``finalize_bootstrap``): the base class's 0 made every request of the step fail on a prefix hit."""
    from kvplan.integrations.sglang.adapter import KVSender

    base, mgr, _ = _prefill_with_decode({7: 2 * sglang_sides.PAGE, 8: 0})
    assert KVSender(mgr, "127.0.0.1:0", 7).pop_decode_prefix_len() == 2 * sglang_sides.PAGE
    assert KVSender(mgr, "127.0.0.1:0", 8).pop_decode_prefix_len() == 0
    assert KVSender(mgr, "127.0.0.1:0", 9).pop_decode_prefix_len() == 0  # no lists yet


def test_a_prefill_abort_fails_the_request_sends_nothing_and_tells_the_decode():
    from kvplan.integrations.sglang.adapter import KVSender, TransferFailed

    base, mgr, decode_end = _prefill_with_decode({7: 0, 8: 0})
    aborted, kept = KVSender(mgr, "127.0.0.1:0", 7), KVSender(mgr, "127.0.0.1:0", 8)
    for sender in (aborted, kept):
        sender.init(2, aux_index=0)
    aborted.send(np.array([3]))  # a first chunk, queued
    aborted.abort()
    assert aborted.poll() == base.KVPoll.Failed
    with pytest.raises(TransferFailed, match="aborted by the prefill's scheduler"):
        aborted.failure_exception()
    told = []  # (the progress thread tells the decode and drops the lists)
    until(lambda: told.extend((kind, header) for kind, header, _ in list(decode_end.inbox)) or
          7 not in mgr.prefill.peers[0].lists and told)
    assert ("failed", {"request": 7, "reason": "aborted by the prefill's scheduler"}) in told
    assert not any(sender.room == 7 for sender, *_ in mgr._pending)  # its queued chunk is dropped
    assert 7 not in mgr.prefill.peers[0].lists and 8 in mgr.prefill.peers[0].lists
    assert kept.poll() != base.KVPoll.Failed
    aborted.clear()
    assert 7 not in mgr.status and 7 not in mgr.failures  # nothing of it is kept


def test_a_decode_abort_reaches_the_prefill_which_fails_it():
    from kvplan.integrations.sglang.adapter import KVSender

    base, mgr, decode_end = _prefill_with_decode({7: 0})
    sender = KVSender(mgr, "127.0.0.1:0", 7)
    sender.init(2, aux_index=0)
    decode_end.send("abort", {"request": 7, "reason": "aborted by the decode's scheduler"})
    assert concluded(sender, base.KVPoll) == base.KVPoll.Failed
    assert "the decode side aborted it" in mgr.failures[7]


def test_a_receiver_whose_prefill_cannot_be_found_fails_instead_of_raising():
    base = sglang_module("srt.disaggregation.base.conn")
    from kvplan.integrations.sglang.adapter import KVReceiver

    kv, aux = sglang_sides.pools(None)
    mgr = _manager(sglang_sides.kv_args_of(base, kv, aux), "DECODE", kvplan_timeout_s=0.5)
    mgr.settings = types.SimpleNamespace(**{**vars(mgr.settings), "bootstrap": "sglang"})  # no server listens
    receiver = KVReceiver(mgr, f"127.0.0.1:{free_port()}", 3)
    assert receiver.conclude_state is None and not receiver.require_staging
    assert not mgr.try_ensure_parallel_info(receiver.bootstrap_addr)  # SGLang tries again later
    receiver.init(0)  # (its lookup runs off the scheduler's thread: the receiver bootstraps until it fails)
    until(lambda: receiver.poll() != base.KVPoll.Bootstrapping)
    assert receiver.poll() == base.KVPoll.Failed and receiver.conclude_state == base.KVPoll.Failed
    assert "no prefill rank to pair with" in mgr.failures[3]
    receiver.send_metadata(np.array([1, 2]), aux_index=0)  # SGLang may still send it: nothing is published
    assert not receiver.published
    receiver.abort()
    assert not receiver.abort_notified  # nothing was published: no prefill to tell
    receiver.clear()
    assert 3 not in mgr.status


def test_the_transfer_metric_is_the_time_from_first_chunk_to_conclusion():
    from kvplan.integrations.sglang.adapter import KVSender

    base, mgr, _ = _prefill_with_decode({7: 0})
    sender = KVSender(mgr, "127.0.0.1:0", 7)
    assert sender.get_transfer_metric().transfer_latency_s is None
    sender.init(2, aux_index=0)
    sender.send(np.array([3]))
    sender.abort()
    assert sender.poll() == base.KVPoll.Failed
    assert sender.get_transfer_metric().transfer_latency_s >= 0


def _prefill_with_paired_decode():
    """A prefill manager with a decode side paired (its memory known) on an in-memory channel, which
    published request 7's lists (pages 3 and 4)."""
    base = sglang_module("srt.disaggregation.base.conn")  # (skips where SGLang is not installed)
    from kvplan.integrations.sglang.kv_args import side_from_kv_args
    from kvplan.planner.contract.plan import DestinationLists
    from kvplan.transport.prefill import Peer
    from tests.transport.fakes import FakeChannel

    kv, aux = sglang_sides.pools(1)
    mgr = _manager(sglang_sides.kv_args_of(base, kv, aux), "PREFILL", max_running_requests=4, context_length=64)
    decode_args = sglang_sides.kv_args_of(base, *sglang_sides.pools(None))
    peer = Peer(FakeChannel.pair()[0], name="decode", side=side_from_kv_args(decode_args, mla=False))
    peer.lists[7] = (DestinationLists(np.array([3, 4]), ()), 0, 0)
    mgr.prefill.peers.append(peer)
    return base, mgr


def test_poll_returns_at_once_while_the_step_s_transfer_is_held_in_flight(caplog):
    """SGLang's scheduler calls ``poll`` every step: it submits what was handed over and reads what
    ended, never waiting for the engine. Here the engine holds the write until the test releases it
    (a slowed peer), after the polls: each of them returns Transferring (a poll that waited for the
    write would wait for ever), and the request succeeds once the write ends. Then the manager's
    counters say so, and its periodic counters line is logged."""
    import logging
    import threading

    base, mgr = _prefill_with_paired_decode()
    from kvplan.integrations.sglang.adapter import KVSender
    from kvplan.transport.engines.base import Handle
    release, posted = threading.Event(), threading.Event()
    mgr.engine.post = lambda peer, descs, *a, **k: posted.set() or Handle(peer, int(descs[:, 2].sum()))
    mgr.engine.progress = lambda h: "DONE" if release.wait(0.001) else "PROC"  # (a bounded wait per look)
    sender = KVSender(mgr, "127.0.0.1:0", 7)
    sender.init(2, aux_index=0)
    sender.send(np.array([3, 4]))
    try:
        assert sender.poll() == base.KVPoll.Transferring  # submitted
        assert posted.wait(30), "the progress thread never posted the write"
        for _ in range(20):
            assert sender.poll() == base.KVPoll.Transferring
    finally:
        release.set()
    assert concluded(sender, base.KVPoll) == base.KVPoll.Success, mgr.failures
    stats = mgr.stats()
    assert stats["requests"].get("sent") == 1 and stats["bytes"] > 0 and stats["peers"] == 1, stats
    mgr.settings = dataclasses.replace(mgr.settings, stats_s=1)
    mgr._counters_at = 0.0  # (due now, rather than a second from now)
    with caplog.at_level(logging.INFO, logger="kvplan.integrations.sglang.adapter"):
        mgr.progress()
    assert "kvplan's SGLang prefill counters: requests {'sent': 1}" in caplog.text, caplog.text


def test_a_chunk_whose_page_ids_are_still_being_copied_waits_for_its_event_and_nothing_waits_on_it():
    """On a GPU SGLang hands ``send`` a pinned host tensor its copy off the GPU is still filling, with the
    copy's event (``supports_host_tensor_indices``), instead of syncing its stream. kvplan asks the event
    at each poll: until it has passed, nothing of the chunk is planned or sent (its ids may not be there
    yet), and the poll returns at once; then the chunk goes."""
    base, mgr = _prefill_with_paired_decode()
    from kvplan.integrations.sglang.adapter import KVSender
    from kvplan.transport.engines.base import Handle
    posted = []
    mgr.engine.post = lambda peer, descs, *a, **k: posted.append(len(descs)) or Handle(peer, int(descs[:, 2].sum()))
    mgr.engine.progress = lambda h: "DONE"
    copy = types.SimpleNamespace(done=False)
    copy.query = lambda: copy.done  # (torch.cuda.Event's query: whether the copy has ended)
    sender = KVSender(mgr, "127.0.0.1:0", 7)
    sender.init(2, aux_index=0)
    sender.send(torch.tensor([3, 4]), indices_event=copy)
    for _ in range(5):
        assert sender.poll() == base.KVPoll.WaitingForInput  # nothing of it planned while it copies
    assert sender.pages_sent == 0 and not posted and mgr.prefill.in_flight() == 0
    copy.done = True
    assert concluded(sender, base.KVPoll) == base.KVPoll.Success, mgr.failures
    assert sender.pages_sent == 2 and posted
