"""kvplan's vLLM connector under vLLM's own ``Scheduler`` on both sides (tests/integrations/vllm_scheduler_node.py):
a prefill engine core and a decode engine core, each in a process of its own, their requests entering through
``add_request``, the connector driven by what the scheduler asks of it and by the model runner's calls in
vLLM's order. Every block of every request the decode's scheduler hears received must hold the prefill's
bytes, and every request must end: decoded to its last token, or aborted, never waiting for ever."""

from __future__ import annotations

import pytest

from kvplan.tools.target_process import child_message, child_pipe, start_child
from tests.isolated import end_all, report_and_exit
from tests.ports import free_port

pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed (make setup-vllm)")

from tests.integrations import vllm_scheduler_node  # noqa: E402

pytestmark = pytest.mark.vllm


def _run(tmp_path, prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = (), engine: str = "nixl"):
    """Both engine cores to their end, each joined or killed by its own handle: what each saw."""
    params = str(tmp_path / "params.json")
    common = ["--port", str(free_port()), "--params", params, "--engine", engine]
    procs, pipes = [], []
    try:
        for role, extra in (("prefill", prefill_args), ("decode", decode_args)):
            here, there = child_pipe()
            procs.append(start_child(report_and_exit, there, vllm_scheduler_node.run, [role, *common, *extra]))
            pipes.append(here)
        decode = child_message(pipes[1], "decode", 150)[1]
        prefill = child_message(pipes[0], "prefill", 60)[1]
    finally:
        end_all(procs)
    return prefill, decode


def test_requests_go_through_both_schedulers_and_land_byte_for_byte(tmp_path):
    """(NIXL: the engines' own paths are test_vllm_transfer.py's; here, what vLLM's scheduler asks.)"""
    prefill, decode = _run(tmp_path)
    assert prefill["sent"] == prefill["written"] == ["p-req-0", "p-req-1", "p-req-2", "p-req-3"], prefill
    assert prefill["held"] == 0, prefill  # (every request's blocks freed once its decode had them)
    assert decode["received"] == decode["requests"] and not decode["failed"] and not decode["wrong"], decode
    assert decode["blocks_checked"] == 3 * (7 + 3 + 4 + 1), decode
    assert set(decode["finished"].values()) == {"length"} and decode["left"] == 0, decode


def test_more_requests_than_planning_rows_wait_for_a_row_and_none_is_dropped(tmp_path):
    """vLLM's scheduler hands the connector every request it admits (max_num_seqs 16); the connector has
    4 planning rows: the others wait for one, in order, and every request lands."""
    lengths = [str(17 + 9 * k) for k in range(12)]
    prefill, decode = _run(tmp_path, ("--lengths", *lengths), ("--max-requests", "4", "--max-num-seqs", "16"))
    assert len(prefill["sent"]) == 12, prefill
    assert decode["received"] == decode["requests"] and len(decode["received"]) == 12, decode
    assert not decode["failed"] and not decode["wrong"] and decode["left"] == 0, decode


def test_a_request_the_decode_aborts_before_its_blocks_came_ends_and_frees_its_prefill_s_blocks(tmp_path):
    """The engine core aborts a request (its client went away) while it waits for its blocks: vLLM's scheduler
    keeps its blocks until the connector reports its load ended (``finished_recving`` of a finished request),
    then frees them; its prefill frees its own; the others land."""
    prefill, decode = _run(tmp_path, decode_args=("--abort", "d-req-1"))
    assert decode["finished"]["d-req-1"] == "abort" and decode["released"] == ["d-req-1"], decode
    assert sorted(decode["received"]) == ["d-req-0", "d-req-2", "d-req-3"] and not decode["wrong"], decode
    assert decode["blocks_checked"] == 3 * (7 + 4 + 1), decode
    assert prefill["held"] == 0 and decode["left"] == 0, (prefill, decode)


def test_a_prefill_restarted_at_its_address_is_paired_with_again_through_both_schedulers(tmp_path):
    """A decode engine outlives its prefill; a new prefill process starts at the same address. The decode's
    next requests (vLLM's proxy hands it the new prefill's parameters) pair anew with whatever listens there,
    and land: nothing of the old pairing is used for them."""
    first, again, port = str(tmp_path / "params.json"), str(tmp_path / "again.json"), str(free_port())
    common = ["--port", port, "--engine", "nixl"]
    procs = []

    def start(*argv):
        here, there = child_pipe()
        procs.append(start_child(report_and_exit, there, vllm_scheduler_node.run, list(argv)))
        return here

    try:
        old = start("prefill", *common, "--params", first)
        decoding = start("decode", *common, "--params", first, "--then-params", again)
        old_saw = child_message(old, "the first prefill", 150)[1]  # (it ends once the decode's first round did)
        procs[0].join(30)
        new = start("prefill", *common, "--params", again, "--names", "q-req-")
        decode = child_message(decoding, "decode", 150)[1]
        new_saw = child_message(new, "the restarted prefill", 60)[1]
    finally:
        end_all(procs)
    assert len(old_saw["sent"]) == 4 and len(new_saw["sent"]) == 4, (old_saw, new_saw)
    assert decode["received"] == decode["requests"] and len(decode["received"]) == 8, decode
    assert not decode["failed"] and not decode["wrong"] and decode["left"] == 0, decode
    assert decode["blocks_checked"] == 2 * 3 * (7 + 3 + 4 + 1), decode
