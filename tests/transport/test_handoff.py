"""A batch planned by kvplan moved between two processes by NIXL and by Mooncake, verified byte for byte.

All four state types, aux, chunking and a decode prefix (``hybrid``), head-sliced descriptors
(``head_sliced``), head-sliced SWA state and sliced Mamba state between TP 4 and 8 (``swa_tp4to8``,
``mamba_tp4to8``), a decode rank gathering from two source ranks (``mamba_tp8to4``), direct,
prepared (NIXL) and staged mode; then the failure paths: a dead peer on either side, a bad
registration, a deadline. Nothing here may hang: every wait has a deadline.

NIXL runs without its progress thread here (``progress_thread=False``, which the library supports):
that thread spins a whole core for as long as its agent lives, and ``make test`` runs two tests at
once on two cores. ``test_batch_arrives_byte_for_byte`` and the fault drills run NIXL as deployed,
with the thread.
"""

import os
from dataclasses import replace

import pytest
import torch

from kvplan.tools.demo import DemoConfig, run_demo
from tests.transport.handoff import LENGTHS, SHAPES

pytestmark = pytest.mark.engines

ENGINES = os.environ.get("KVPLAN_TEST_ENGINES", "nixl,mooncake").split(",")
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"


def config(engine: str, shape: str = "hybrid", mode: str = "direct", **kw) -> DemoConfig:
    """The demo's run of ``shape``; NIXL without its progress thread unless ``deployed`` (module docstring)."""
    deployed = kw.pop("deployed", False) or "fault" in kw
    return DemoConfig(shape=SHAPES[shape], requests=len(LENGTHS), prompt_len=LENGTHS, chunks=2, prefix_len=8, seed=3,
                      engine=engine, mode=mode, device=DEVICE, staging_bytes=1 << 22, timeout=kw.pop("timeout", 30.0),
                      progress_thread=deployed, **kw)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("shape, mode", [("hybrid", "direct"), ("hybrid", "staged"), ("head_sliced", "direct"),
                                         ("head_sliced", "staged"), ("swa_tp4to8", "direct"),
                                         ("swa_tp4to8", "staged"), ("mamba_tp4to8", "direct"),
                                         ("mamba_tp4to8", "staged")])
def test_batch_arrives_byte_for_byte(engine, shape, mode):
    report = run_demo(config(engine, shape, mode, deployed=True))
    assert all(reason is None for reason in report.send_failures.values()), report.send_failures
    assert set(report.states.values()) == {"complete"}, report.failures
    assert report.verified is True, "the destination pools differ from the reference execution"
    assert report.ok
    if mode == "staged":  # a TP scatter's head slices and state blocks fill whole destination items
        assert "receiver-planned scatter" in report.mode_used, report.mode_used


@pytest.mark.parametrize("engine, shape, dst_page_size, mode", [
    ("nixl", "kv16", 64, "direct"), ("mooncake", "kv16", 64, "direct"), ("nixl", "kv64", 16, "staged"),
    ("mooncake", "kv64", 16, "direct"), ("nixl", "kv1", 64, "direct"), ("nixl", "ring_mamba", 16, "direct"),
    ("nixl", "dsa16", 64, "direct"), ("mooncake", "dsa16", 4, "staged"), ("nixl", "swa16", 64, "direct"),
    ("mooncake", "swa16", 4, "direct"), ("nixl", "swa1", 64, "direct"), ("nixl", "swa64", 16, "direct"),
    ("mooncake", "dsa64", 16, "direct"), ("nixl", "dsa1", 64, "direct"), ("nixl", "hybrid", 16, "staged"),
    ("nixl", "head_sliced", 16, "direct"), ("mooncake", "head_sliced", 1, "staged")])
def test_sides_of_different_page_sizes_hand_off_byte_for_byte(engine, shape, dst_page_size, mode):
    """16 -> 64, 64 -> 16 and 1 -> 64 (docs/page_sizes.md), chunked, with aux rows; 4 -> 16 with ring
    and Mamba state; 16 -> 64, 64 -> 16, 16 -> 4 and 1 -> 64 with DSA state and with SWA state in units;
    4 -> 16 with every state kind at once, staged; head-sliced KV (TP 2 -> 4) 4 -> 16 and 4 -> 1."""
    if engine not in ENGINES:
        pytest.skip(f"{engine} is not among the engines of this run")
    report = run_demo(replace(config(engine, shape, mode), prefix_len=0, dst_page_size=dst_page_size))
    assert set(report.states.values()) == {"complete"}, report.failures
    assert report.verified is True, "the destination pools differ from the reference execution"
    assert report.ok


@pytest.mark.parametrize("engine, shape, mode", [(e, s, "direct") for e in ENGINES for s in ("hybrid", "mamba_tp4to8")]
                         + [(ENGINES[0], "head_sliced", "direct")]
                         + [(e, s, "staged") for e in ENGINES for s in ("hybrid", "mamba_tp4to8")])
def test_a_batch_streamed_in_layer_groups_behind_its_forward_pass_arrives_byte_for_byte(engine, shape, mode):
    """docs/layerwise.md: every state kind (``hybrid``), sliced Mamba state, head-sliced KV; direct
    writes, and a staged run per group (destination tables checked by the receiver). The stand-in
    forward pass zeroes the pool and writes it layer by layer, so a group sent before it was
    written would move zeros; two batches in a row (the readiness word is reset between)."""
    report = run_demo(replace(config(engine, shape, mode), layer_groups=2, forward_dim=32, repeat=2))
    assert set(report.states.values()) == {"complete"}, report.failures
    assert report.verified is True, "the destination pools differ from the reference execution"
    assert report.ok and report.exposed_s is not None and report.mode_used.startswith(mode)


@pytest.mark.skipif(DEVICE != "cuda", reason="gathering ahead waits on the forward pass's CUDA events")
def test_staged_groups_gathered_ahead_of_a_slow_forward_pass_move_only_written_bytes():
    """docs/layerwise.md §3: the sender queues a group's gathers behind the event the forward pass
    records with its mark, before the group is written. The pass is slow here (a large matmul per
    layer) and zeroes the pool first, so a gather that ran early would move zeros."""
    report = run_demo(replace(config(ENGINES[0], "hybrid", "staged"), layer_groups=2, forward_dim=8192, repeat=2))
    assert report.ok and report.verified is True, report.failures
    assert "gathered ahead" in (report.mode_used or ""), report.mode_used


@pytest.mark.parametrize("engine, mode", [(e, "direct") for e in ENGINES] + [(ENGINES[0], "staged")])
def test_a_decode_rank_gathers_its_part_from_every_source_rank_of_its_group(engine, mode):
    """TP 8 -> 4 (docs/tp_state.md §4): a prefill process per source rank of the group, each with its
    own KV heads and Mamba slices (and the same replicated items and aux), into one decode rank; the
    decode's pools are checked against the reference execution of every source's plan."""
    gathered = replace(config(engine, "mamba_tp8to4", mode), gather=True)
    assert gathered.sources() == [0, 1]
    report = run_demo(gathered)
    assert set(report.states.values()) == {"complete"}, report.failures
    assert report.verified is True, "the destination pools differ from the reference execution"
    assert report.ok and not any(report.send_failures.values())
    if mode == "staged":  # each source's part planned by the decode from that source's layout
        assert "receiver-planned scatter" in report.mode_used, report.mode_used


@pytest.mark.parametrize("engine", ENGINES[:1])
def test_staged_batches_larger_than_the_staging_buffers_go_in_waves(engine):
    report = run_demo(replace(config(engine, "hybrid", "staged"), staging_bytes=16 << 10))
    assert report.ok, report.render()


@pytest.mark.parametrize("engine", ENGINES[:1])
def test_a_transfer_larger_than_the_staging_buffers_goes_in_pieces(engine):
    # transfers here hold 5632 + 9808, 1536 + 5216 and 3584 + 6528 bytes; 4 slots of 1536 bytes each,
    # so transfers and some descriptors are split over several waves
    report = run_demo(replace(config(engine, "hybrid", "staged"), staging_bytes=6144, repeat=3 if DEVICE == "cuda" else 1))
    assert report.ok, report.render()


@pytest.mark.parametrize("engine", ENGINES)
def test_staged_mode_completes_batch_after_batch(engine):
    # each batch's last wave must be credited before the sender reports it sent (the staged race); on a CPU,
    # where the interpreter plans each batch for a second, ten batches (make test's time; the GPU suite twenty)
    batches = 20 if DEVICE == "cuda" else 10
    report = run_demo(replace(config(engine, "hybrid", "staged"), staging_bytes=16 << 10, repeat=batches))
    assert report.ok, report.render()
    assert len(report.send_failures) == batches * len(LENGTHS) and not any(report.send_failures.values())
    # NIXL's and ipc's notifications carry the credits back; Mooncake has none, so its credits take the channel
    assert ("credits through the engine" in report.mode_used) == (engine in ("nixl", "ipc")), report.mode_used
    if DEVICE == "cuda":  # every batch had its first wave gathered behind the plan (.ahead), as a graph: the
        # first one too, whose gather the warm-up shaped (before session 27, batches 2-20)
        assert "20 first waves gathered behind their plans" in report.mode_used, report.mode_used
        assert "as graphs" in report.mode_used, report.mode_used


def test_nixl_prepared_lists_arrive_byte_for_byte():
    if "nixl" not in ENGINES:
        pytest.skip("NIXL is not among the engines of this run")
    report = run_demo(config("nixl", "hybrid", "prepared"))
    assert report.ok, report.render()


@pytest.mark.parametrize("engine", ENGINES)
def test_dead_decode_peer_fails_every_request_without_hanging(engine):
    report = run_demo(config(engine, fault="dead-decode", timeout=20))
    assert len(report.send_failures) == len(LENGTHS)
    assert all("the decode side is gone" in (why or "") for why in report.send_failures.values()), \
        report.send_failures
    assert report.drill_observed()


@pytest.mark.parametrize("engine", ENGINES)
def test_dead_prefill_peer_fails_every_request(engine):
    report = run_demo(config(engine, fault="dead-prefill"))
    assert set(report.states.values()) == {"failed"} and report.verified is None
    assert all("the prefill side is gone" in r or "could not be published" in r for r in report.failures.values()), \
        report.failures
    assert report.drill_observed()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_prefill_dying_mid_transfer_fails_its_requests_without_waiting_for_the_deadline(engine):
    report = run_demo(config(engine, "hybrid", "staged", fault="dead-prefill-mid", timeout=60))
    assert set(report.states.values()) == {"failed"} and report.verified is None
    assert all("the prefill side is gone" in r for r in report.failures.values()), report.failures


@pytest.mark.parametrize("engine", ENGINES)
def test_a_decode_dying_mid_transfer_fails_the_rest_on_the_prefill(engine):
    report = run_demo(replace(config(engine, "hybrid", "staged", fault="dead-decode-mid", timeout=60),
                              staging_bytes=8 << 10))
    failed = {r: why for r, why in report.send_failures.items() if why}
    assert failed and len(failed) < len(LENGTHS), report.send_failures  # one completed before the death
    assert all("the decode side is gone" in why for why in failed.values()), failed


@pytest.mark.parametrize("engine", ENGINES)
def test_requests_that_never_arrive_fail_at_their_deadline(engine):
    report = run_demo(config(engine, fault="deadline"))
    assert set(report.states.values()) == {"failed"} and report.verified is None
    assert all("deadline passed" in reason for reason in report.failures.values()), report.failures


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_bad_registration_is_refused_on_both_sides(mode):
    """Staged: the decode's warm-up reads the refusal while it waits for the pairing; the requests it
    publishes afterwards fail at once with it (not on their deadline)."""
    report = run_demo(config(ENGINES[0], mode=mode, fault="bad-registration", timeout=20))
    assert report.refused and "aux: source has 2 entries, destination 0" in report.refused
    assert set(report.states.values()) == {"failed"}
    assert all("refused the pairing" in f for f in report.failures.values())
