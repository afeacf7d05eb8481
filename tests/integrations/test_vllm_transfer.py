"""kvplan's vLLM connector moving bytes between a prefill and a decode process.

Each process is a vLLM engine reduced to what touches the connector (:mod:`tests.integrations.vllm_node`):
kvplan's connector built by vLLM's factory, KV caches allocated by vLLM's ``allocate_kv_cache`` in the
layout under test, the engine loop's connector calls in vLLM's order. The prefill's blocks hold bytes
drawn from each request's name; the decode, into blocks of its own, must end with every byte of every
block of every layer equal, and every request it could not load reported in ``failed_recving`` with its
blocks in ``get_block_ids_with_load_errors``: never as a success.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvplan.tools.target_process import child_message, child_pipe, start_child
from tests.isolated import end_all, report_and_exit
from tests.ports import free_port, free_span

pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed (make setup-vllm)")

from tests.integrations import vllm_node  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]

REQUESTS = ["d-req-0", "d-req-1", "d-req-2", "d-req-3"]  # (the node's lengths: 100, 37, 64, 5 tokens)


def run_pair(tmp_path, engine: str, prefill_layout: str, decode_layout: str, *decode_args: str,
             prefill_args: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """Both processes, to their end (each has its own deadline), each joined or killed by its own
    handle; what each saw. They are forked from the tests' fork server, which has imported vLLM
    (tests/preload.py), with loopback for UCX (conftest.py: the test's choice)."""
    prefill, decodes = run_group(tmp_path, engine, prefill_layout, decode_layout, decode_args, prefill_args)
    return prefill, decodes[0]


def run_group(tmp_path, engine: str, prefill_layout: str, decode_layout: str, decode_args: tuple[str, ...] = (),
              prefill_args: tuple[str, ...] = (), decode_tp: int = 1, prefill_tp: int = 1,
              decode_ranks: int | None = None) -> tuple[dict, list[dict]]:
    """A process per rank of a prefill of TP ``prefill_tp`` and of a decode of TP ``decode_tp`` (its first
    ``decode_ranks`` only, where given: the others never came): what the prefill's rank 0 and each decode
    rank saw."""
    params = str(tmp_path / "params.json")
    prefill_port = free_span(prefill_tp)  # (prefill rank r listens at its engine's port + r)
    argv = lambda role, layout, port: [role, "--port", str(port), "--params", params, "--engine", engine,  # noqa: E731
                                       "--layout", layout]
    running = decode_tp if decode_ranks is None else decode_ranks
    served = max(1, min(running, decode_tp // prefill_tp))  # the decode ranks each prefill rank serves (that run)
    sides = [("prefill", prefill_layout, prefill_port, (*prefill_args, "--decode-ranks", str(served), "--tp-size",
                                                        str(prefill_tp), "--tp-rank", str(rank)))
             for rank in range(prefill_tp)]
    sides += [("decode", decode_layout, free_port(), (*decode_args, "--tp-size", str(decode_tp), "--tp-rank", str(rank)))
              for rank in range(running)]
    procs, results = [], []
    try:
        for role, layout, port, extra in sides:
            here, there = child_pipe()
            procs.append(start_child(report_and_exit, there, vllm_node.run, [*argv(role, layout, port), *extra]))
            results.append(here)
        try:
            decodes = [child_message(here, f"decode {rank}", 150)[1] for rank, here in enumerate(results[prefill_tp:])]
        except (RuntimeError, TimeoutError) as err:  # (a decode that waited on a prefill: say what the prefill said)
            said = [here.recv() if here.poll(1) else ("nothing",) for here in results[:prefill_tp]]
            raise RuntimeError(f"{err}\nthe prefill ranks said: {said}") from None
        prefills = [child_message(here, f"prefill {rank}", 60)[1] for rank, here in enumerate(results[:prefill_tp])]
        prefill = prefills[0]
        for decode in decodes:  # (the prefill's connector stats ride with what the decodes saw)
            decode["prefill_stats"] = prefill.get("stats")
        for each in prefills:  # (and its step times: the benchmarks' business)
            each.pop("stats", None)
            each.pop("step", None)
    finally:
        end_all(procs)
    return prefill, decodes


@pytest.mark.parametrize("engine, layout, mode", [("nixl", "LBNHC", "auto"), ("nixl", "BLHNC", "prepared"),
                                                ("mooncake", "LBHNC", "direct"), ("ipc", "LBNHC", "direct")])
def test_every_byte_of_every_block_lands_and_a_request_its_prefill_never_had_is_reported_failed(tmp_path, engine,
                                                                                               layout, mode):
    if engine == "mooncake":
        pytest.importorskip("mooncake.engine", reason="Mooncake is not installed")
    # (12 s: the ghost fails at its deadline, and the real requests must beat it on a loaded two-core machine,
    # where 6 s once passed before the prefill process had started, with the engines' environments being built)
    sent, got = run_pair(tmp_path, engine, layout, layout, "--ghost", "--timeout", "12",
                         prefill_args=("--mode", mode))
    prefill_stats = got["prefill_stats"]
    assert sent == {"sent": ["p-req-0", "p-req-1", "p-req-2", "p-req-3"], "freed": True}  # (its blocks freed after)
    assert got["received"] == REQUESTS + ["d-req-4"]  # every request ends, the failed one too (vLLM frees it)
    assert got["failed"] == ["d-req-4"] and got["invalid_blocks"] == got["ghost_blocks"] != []
    assert got["wrong"] == [] and got["blocks_checked"] == 7 + 3 + 4 + 1
    # vLLM's connector stats, summed over the steps' intervals: what each side's endpoints counted
    assert prefill_stats["Requests sent"] == 4 and prefill_stats["MiB moved"] > 0, prefill_stats
    decode_stats = got["stats"]
    assert decode_stats["Requests received"] == 4 and decode_stats["Requests failed"] == 1, decode_stats
    assert decode_stats["MiB moved"] > 0 and decode_stats["Avg request time (ms)"] > 0, decode_stats


def test_a_decode_with_the_integrity_key_completes_every_request_whose_checksums_agree(tmp_path):
    sent, got = run_pair(tmp_path, "nixl", "LBNHC", "LBNHC", "--integrity", "--timeout", "20")  # (margin: all succeed)
    assert got["integrity"] == [True]  # (the key reached every decode endpoint the connector made)
    assert got["received"] == REQUESTS and got["failed"] == [] and got["wrong"] == []
    assert got["blocks_checked"] == 7 + 3 + 4 + 1


def test_sides_whose_blocks_are_laid_out_differently_do_not_pair_and_every_load_fails(tmp_path):
    sent, got = run_pair(tmp_path, "nixl", "LBNHC", "LBHNC", "--timeout", "6", prefill_args=("--timeout", "6"))
    assert got["failed"] == got["received"] == REQUESTS  # reported, none as a success
    assert len(got["invalid_blocks"]) == 7 + 3 + 4 + 1
    assert sent["sent"] == ["p-req-0", "p-req-1", "p-req-2", "p-req-3"]  # (freed: no decode asked within 6 s)


def test_a_prefill_gone_before_its_decode_came_fails_every_load(tmp_path):
    sent, got = run_pair(tmp_path, "nixl", "LBNHC", "LBNHC", "--timeout", "6", prefill_args=("--exit-early",))
    assert got["pairing_after_first_step"] is True  # the step did not wait for the handshake (5 s to nowhere)
    assert got["failed"] == got["received"] == REQUESTS
    assert len(got["invalid_blocks"]) == 7 + 3 + 4 + 1


@pytest.mark.parametrize("prefill_block, decode_block, mode", [(16, 32, "direct"), (32, 16, "auto")])
def test_sides_of_other_block_sizes_move_every_token_where_blocks_hold_their_tokens_in_order(tmp_path, prefill_block,
                                                                                            decode_block, mode):
    by_token = ("--by-token", "--timeout", "20")  # (a success ends at once: the deadline is margin on a loaded machine)
    sent, got = run_pair(tmp_path, "nixl", "LBNHC", "LBNHC", *by_token, "--block-size", str(decode_block),
                         prefill_args=(*by_token, "--mode", mode, "--block-size", str(prefill_block)))
    assert sent == {"sent": ["p-req-0", "p-req-1", "p-req-2", "p-req-3"], "freed": True}
    assert got["received"] == REQUESTS and got["failed"] == [] and got["invalid_blocks"] == []
    assert got["wrong"] == [] and got["tokens_checked"] == (100 + 37 + 64 + 5) * len(vllm_node.LAYERS)


def test_sides_of_other_block_sizes_do_not_pair_where_the_heads_come_before_the_tokens(tmp_path):
    sent, got = run_pair(tmp_path, "nixl", "LBHNC", "LBHNC", "--timeout", "6", "--block-size", "32",
                         prefill_args=("--timeout", "6"))
    assert got["failed"] == got["received"] == REQUESTS  # reported, none as a success
    assert sent["sent"] == ["p-req-0", "p-req-1", "p-req-2", "p-req-3"]


@pytest.mark.parametrize("layout, mode", [("LBNHC", "direct"), ("LBNHC", "auto"), ("LBHNC", "prepared")])
def test_a_decode_of_a_larger_tp_size_receives_each_rank_s_heads_of_every_token(tmp_path, layout, mode):
    """Prefill TP 1 (both heads), decode TP 2 (a head per rank): the prefill rank writes each decode rank
    its head of every token, K and V together (LBNHC: token by token; LBHNC: the head's span of each block,
    through NIXL prepared lists of those spans, as vLLM's NIXL connector moves them), and frees the blocks once
    both have been written."""
    by_token = ("--by-token", "--timeout", "20")  # (a success ends at once: the deadline is margin on a loaded machine)
    sent, got = run_group(tmp_path, "nixl", layout, layout, by_token, (*by_token, "--mode", mode), decode_tp=2)
    assert sent == {"sent": ["p-req-0", "p-req-1", "p-req-2", "p-req-3"], "freed": True}
    for rank in got:
        assert rank["received"] == REQUESTS and rank["failed"] == [] and rank["wrong"] == []
        assert rank["tokens_checked"] == (100 + 37 + 64 + 5) * len(vllm_node.LAYERS)


def test_a_decode_of_a_larger_tp_size_does_not_pair_where_blocks_move_whole(tmp_path):
    sent, got = run_group(tmp_path, "nixl", "BLHNC", "BLHNC", ("--timeout", "6"), ("--timeout", "6"), decode_tp=2)
    for rank in got:
        assert rank["failed"] == rank["received"] == REQUESTS  # reported, none as a success


@pytest.mark.parametrize("layout, mode", [("LBNHC", "direct"), ("LBHNC", "prepared")])
def test_a_decode_of_a_smaller_tp_size_gathers_each_prefill_rank_s_heads_of_every_token(tmp_path, layout, mode):
    """Prefill TP 2 (a head per rank), decode TP 1 (both heads): the decode publishes its blocks to both
    prefill ranks, and each writes its head of every token into them (a gather)."""
    by_token = ("--by-token", "--timeout", "20")  # (a success ends at once: the deadline is margin on a loaded machine)
    sent, got = run_group(tmp_path, "nixl", layout, layout, by_token, (*by_token, "--mode", mode), prefill_tp=2)
    assert sent == {"sent": ["p-req-0", "p-req-1", "p-req-2", "p-req-3"], "freed": True}
    assert got[0]["received"] == REQUESTS and got[0]["failed"] == [] and got[0]["wrong"] == []
    assert got[0]["tokens_checked"] == (100 + 37 + 64 + 5) * len(vllm_node.LAYERS)


def test_a_request_some_decode_ranks_never_asked_for_fails_on_the_ranks_that_did_never_as_a_success(tmp_path):
    """Decode TP 2 of prefill TP 1, rank 1 never comes: the prefill rank waits for both ranks' blocks, gives
    each request up at its deadline and frees its blocks; rank 0 reports every load failed, with its blocks."""
    args = ("--timeout", "4")
    sent, got = run_group(tmp_path, "nixl", "LBNHC", "LBNHC", args, args, decode_tp=2, decode_ranks=1)
    assert sent["sent"] == ["p-req-0", "p-req-1", "p-req-2", "p-req-3"]  # (freed: given up at its deadline)
    assert got[0]["failed"] == got[0]["received"] == REQUESTS  # reported, none as a success
    assert len(got[0]["invalid_blocks"]) == 7 + 3 + 4 + 1


WINDOW = 40  # (tokens: the next token attends to 39 of the prompt's; blocks of 16)


def _window_tokens(lengths) -> int:
    """Tokens checked per request set: every token of the full-attention layers, the window's of the others."""
    return sum(n * len(vllm_node.LAYERS) + min(n, WINDOW - 1) * len(vllm_node.WINDOW_LAYERS) for n in lengths)


def test_a_sliding_window_group_moves_its_window_and_a_request_whose_window_block_was_freed_fails(tmp_path):
    """A full-attention group and a sliding-window group (vLLM's hybrid KV cache manager), LBHNC: the decode
    receives every token of the full group and the window's tokens of the other, each into its own blocks. A
    request whose window lost a block on the prefill (mapped to vLLM's null block) fails, named, never lands."""
    args = ("--by-token", "--timeout", "20", "--window", str(WINDOW))
    sent, got = run_pair(tmp_path, "nixl", "LBHNC", "LBHNC", *args,
                         prefill_args=(*args, "--mode", "direct", "--freed-window-block"))
    assert sent["sent"] == ["p-req-0", "p-req-1", "p-req-2", "p-req-3"]
    assert got["received"] == REQUESTS and got["failed"] == ["d-req-0"] and got["wrong"] == []
    assert got["tokens_checked"] == _window_tokens([37, 64, 5])


def test_a_sliding_window_group_of_smaller_padded_blocks_moves_its_window_token_by_token(tmp_path):
    """vLLM's hybrid manager with attention groups of two block sizes: the sliding-window group's blocks hold
    4 tokens, each padded to the full group's page of 16 (``page_size_padded``). Its window moves through a
    token-by-token map, each block whole; every token of both groups is checked."""
    args = ("--by-token", "--timeout", "20", "--window", str(WINDOW), "--window-block-size", "4",
            "--lengths", "100", "37", "5")
    sent, got = run_pair(tmp_path, "nixl", "LBHNC", "LBHNC", *args, prefill_args=(*args, "--mode", "auto"))
    assert sent["sent"] == ["p-req-0", "p-req-1", "p-req-2"]
    assert got["received"] == REQUESTS[:3] and got["failed"] == [] and got["wrong"] == []
    assert got["tokens_checked"] == _window_tokens([100, 37, 5])


@pytest.mark.parametrize("mode", ["prepared", "direct"])
def test_a_sliding_window_group_moves_by_head_to_a_decode_of_a_larger_tp_size(tmp_path, mode):
    args = ("--by-token", "--timeout", "20", "--window", str(WINDOW))
    sent, got = run_group(tmp_path, "nixl", "LBHNC", "LBHNC", args, (*args, "--mode", mode), decode_tp=2)
    assert sent == {"sent": ["p-req-0", "p-req-1", "p-req-2", "p-req-3"], "freed": True}
    for rank in got:
        assert rank["received"] == REQUESTS and rank["failed"] == [] and rank["wrong"] == []
        assert rank["tokens_checked"] == _window_tokens([100, 37, 64, 5])


@pytest.mark.parametrize("mode, scratch", [("direct", 0), ("auto", 2)])
def test_a_mamba_group_moves_each_request_s_state_block_and_the_prompt_but_its_last_token(tmp_path, mode, scratch):
    """A full-attention group and a Mamba group (vLLM's hybrid KV cache manager, the state padded to the
    attention page): the prefill, told of each request, leaves the prompt's last token to the decode; the
    decode loads the rest, every block of the full group, and each request's state block receives the
    prefill's state byte for byte (after ``scratch`` speculative blocks, which stay)."""
    args = ("--mamba", "--scratch-blocks", str(scratch), "--timeout", "20")
    prefill, decode = run_pair(tmp_path, "nixl", "LBHNC", "LBHNC", *args, prefill_args=(*args, "--mode", mode))
    assert decode["received"] == REQUESTS and not decode["failed"] and not decode["wrong"], decode
    assert decode["states_checked"] == len(REQUESTS)
    assert prefill["sent"] == ["p-req-0", "p-req-1", "p-req-2", "p-req-3"] and prefill["freed"]


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1)])
def test_a_mamba_group_moves_each_rank_s_part_of_the_state_to_a_decode_of_another_tp_size(tmp_path, prefill_tp,
                                                                                          decode_tp):
    """Mamba2 state between TP sizes: each decode rank's page ends holding its part of the model's conv state
    (each of ``x | B | C``) and of its temporal state (its heads), from the prefill rank that holds it
    (TP 1 -> 2) or from both prefill ranks (TP 2 -> 1, a gather), beside every head of every KV token."""
    args = ("--mamba", "--by-token", "--timeout", "20", "--lengths", "37", "5")
    sent, got = run_group(tmp_path, "nixl", "LBHNC", "LBHNC", args, (*args, "--mode", "direct"),
                          decode_tp=decode_tp, prefill_tp=prefill_tp)
    assert sent["sent"] == ["p-req-0", "p-req-1"]
    for rank in got:
        assert rank["received"] == REQUESTS[:2] and rank["failed"] == [] and rank["wrong"] == [], rank
        assert rank["states_checked"] == 2


def test_vllm_s_own_nixl_connector_moves_the_same_requests_through_the_same_harness(tmp_path):
    """The baseline of ``benchmarks/vllm_backends.py``: vLLM's own ``NixlConnector`` (real NIXL, UCX over
    loopback) driven by the same two processes and the same engine calls as kvplan's, every byte of every
    block checked, with the step and ready times the benchmark reads. A harness that could not move vLLM's
    own connector's bytes would compare kvplan with nothing."""
    args = ("--connector", "nixl", "--block-size", "32", "--timeout", "20")
    sent, got = run_pair(tmp_path, "nixl", "LBNHC", "LBNHC", *args, prefill_args=args)
    assert sent == {"sent": ["p-req-0", "p-req-1", "p-req-2", "p-req-3"], "freed": True}
    assert got["received"] == REQUESTS and got["failed"] == [] and got["wrong"] == []
    assert got["blocks_checked"] == 4 + 2 + 2 + 1  # (100, 37, 64 and 5 tokens in blocks of 32)
    assert got["bytes"] == got["blocks_checked"] * 3 * 2 * 32 * 2 * 16 * 2  # (layers x K/V x tokens x heads x 16 bf16)
    assert got["ready"]["count"] == len(REQUESTS) and got["step"]["count"] > 0


def test_two_sending_engines_on_one_host_whose_ports_overlap_stop_at_start_naming_the_port(tmp_path):
    """A prefill and a kv_both decode with the same settings on one host: the second to start cannot listen
    at port + rank, and stops with one line naming the port and the rule, not a ZeroMQ traceback."""
    port = free_port()
    code = ("import sys\n"
            "from tests.integrations import vllm_node as n\n"
            "from kvplan.integrations.vllm.scheduler import UnsupportedConfig\n"
            f"extra = {{'host': '127.0.0.1', 'port': {port}, 'engine': 'nixl', 'warm_up': {{}}}}\n"
            "layout = n.KVCacheLayout['LBNHC']\n"
            "first = n.connectors('prefill', extra, 16, layout, 'prefill-engine', n.BLOCK)  # (kept: it listens)\n"
            "try:\n"
            "    n.connectors('decode', extra, 16, layout, 'decode-engine', n.BLOCK)\n"
            "except UnsupportedConfig as err:\n"
            "    print(err)\n"
            "    sys.exit(3)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={**os.environ, "UCX_NET_DEVICES": "lo"})
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    said = done.stdout.strip().splitlines()[-1]
    assert f"rank 0 listens at port {port} + 0, but 127.0.0.1:{port} is taken" in said, said
    assert "kv_role kv_consumer" in said and "do not overlap" in said, said


def test_a_prefill_restarted_at_its_address_is_paired_with_again_by_a_decode_that_outlived_it(tmp_path):
    """A decode serves a prefill's requests; that prefill process ends, a new one starts at the same address,
    and the decode (the same process, the same connector) gets that one's requests: it pairs with the new
    process (the old one's channel is a port nobody listens at any more) and receives every byte. Through
    vLLM's connector calls on both sides; the old endpoint is closed with its engine once nothing uses it."""
    first, second = str(tmp_path / "first.json"), str(tmp_path / "second.json")
    port, decode_port = free_port(), free_port()  # (the prefills' address; the decode's own, a kv_both engine's)
    argv = lambda role, params, *extra: [role, "--port", str(decode_port if role == "decode" else port),  # noqa: E731
                                         "--params", params, "--engine", "nixl", "--layout", "LBNHC", "--timeout", "20",
                                         *extra]
    procs = []
    try:
        pipes = []
        for args in (argv("decode", first, "--then-params", second), argv("prefill", first)):
            here, there = child_pipe()
            procs.append(start_child(report_and_exit, there, vllm_node.run, args))
            pipes.append(here)
        sent = child_message(pipes[1], "the first prefill", 150)[1]  # (it ends once the decode checked its bytes)
        procs[1].join(10)
        here, there = child_pipe()
        procs.append(start_child(report_and_exit, there, vllm_node.run, argv("prefill", second, "--names", "q-req-")))
        got = child_message(pipes[0], "the decode", 150)[1]
        sent_again = child_message(here, "the second prefill", 60)[1]
    finally:
        end_all(procs)
    assert sent["sent"] == ["p-req-0", "p-req-1", "p-req-2", "p-req-3"]
    assert sent_again["sent"] == ["q-req-0", "q-req-1", "q-req-2", "q-req-3"]
    again = [f"d1-req-{i}" for i in range(4)]
    assert got["received"] == sorted(REQUESTS + again) and got["failed"] == [] and got["wrong"] == [], got
    assert got["blocks_checked"] == 2 * (7 + 3 + 4 + 1)
    assert got["endpoints"] == 1 and got["retired_open"] == 0  # (the old one closed, with its engine)


def test_a_step_that_hands_over_more_requests_than_planning_rows_loses_none_of_them(tmp_path):
    """vLLM hands a connector as many requests in a step as its KV blocks allow, not ``max_num_seqs``: here 4
    finished prefills and 4 loads at once against 2 planning rows a side. Those beyond the rows wait, in
    order, and take rows as earlier ones end: every request arrives, every byte checked (the old bound freed 2
    sends unsent, which their decode failed at its deadline, and failed 2 loads at once)."""
    args = ("--max-requests", "2", "--timeout", "20")
    sent, got = run_pair(tmp_path, "nixl", "LBNHC", "LBNHC", *args, prefill_args=args)
    assert sent == {"sent": ["p-req-0", "p-req-1", "p-req-2", "p-req-3"], "freed": True}
    assert got["received"] == REQUESTS and got["failed"] == [] and got["wrong"] == [], got
    assert got["blocks_checked"] == 7 + 3 + 4 + 1


def test_every_prompt_length_up_to_four_windows_moves_through_vllm_s_sliding_window_blocks(tmp_path):
    """Every prompt length from 1 to four windows (40 tokens, blocks of 16): each request's window group as
    vLLM's scheduler hands it over on both sides (null blocks where a block lies wholly before the window,
    a length at, before and past every window and block boundary), every token of both groups checked."""
    lengths = [str(n) for n in range(1, 4 * WINDOW + 1)]
    # (160 requests planned by Triton's interpreter beside make test's other passes: the last few ran past a
    # 60 s deadline with two vLLM workers on two cores; the node's loop and the wait for it stay within 150 s)
    args = ("--by-token", "--timeout", "115", "--window", str(WINDOW), "--lengths", *lengths)
    sent, got = run_pair(tmp_path, "nixl", "LBHNC", "LBHNC", *args, prefill_args=(*args, "--mode", "auto"))
    assert len(sent["sent"]) == len(lengths) and sent["freed"]
    assert len(got["received"]) == len(lengths) and got["failed"] == [] and got["wrong"] == [], got["failed"]
    assert got["tokens_checked"] == _window_tokens(range(1, 4 * WINDOW + 1))


def test_a_decode_s_prefix_cache_hit_loads_only_the_rest_and_every_block_ends_right(tmp_path):
    """A decode whose prefix cache holds a prompt's first blocks (32 tokens; never the whole prompt) loads the
    rest only: vLLM hands the connector every block of the request and the count of tokens to load, the
    worker publishes the blocks past the hit, the prefill writes those, and every block of every request
    holds its prefill's bytes (the hit's from the cache, the rest written)."""
    sent, got = run_pair(tmp_path, "nixl", "LBNHC", "LBNHC", "--prefix-hit", "32", "--timeout", "20")
    assert sent == {"sent": ["p-req-0", "p-req-1", "p-req-2", "p-req-3"], "freed": True}
    assert got["received"] == REQUESTS and got["failed"] == [] and got["wrong"] == [], got
    assert got["blocks_checked"] == 7 + 3 + 4 + 1
    assert got["prefill_stats"]["MiB moved"] < got["bytes"] / 2**20  # (the hits' blocks were not sent)
