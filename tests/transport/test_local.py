"""In-process execution of plans: direct and staged copies land the same bytes as the reference."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.planner.device import eager
from kvplan.planner.contract.batch import Batch
from kvplan.planner.reference.oracle import plan_reference
from kvplan.tools.scenarios import materialize
from kvplan.transport.local import gather, plan_alignment, run_direct, scatter, staging_offsets
from kvplan.tools.verify import AddressSpace, execute
from tests.planner.device.test_eager import on_device
from tests.planner.reference.test_properties import scenarios
from tests.draws import examples


def _whole_stream(real: Batch, device: torch.device, typical_bytes: int):
    """The plan's device descriptors, their staging offsets, the copy word, the stream's bytes and
    the whole stream gathered into one buffer."""
    descs = eager.plan(on_device(real, device)).device_descriptors()
    align = plan_alignment(real)
    offsets, ends = staging_offsets(descs)
    total = int(ends[-1]) if len(ends) else 0
    staging = torch.zeros(total, dtype=torch.uint8, device=device)
    gather(descs, offsets, staging, align, typical_bytes)
    return descs, offsets, align, total, staging


def _real_batch(batch: Batch, device: torch.device):
    src, src_tensors = materialize(batch.src, device, seed=11)
    dst, dst_tensors = materialize(batch.dsts[0], device)
    real = Batch(src, (dst,), batch.transfers, batch.policy, batch.validate)
    return real, src_tensors, dst_tensors


@settings(max_examples=examples(25), deadline=None)
@given(scenarios() | scenarios(head_sliced=True), st.booleans(), st.sampled_from([16, 4096]))
def test_local_execution_matches_the_reference(device, case, staged, typical_bytes):
    _, batch = case
    real, src_tensors, dst_tensors = _real_batch(batch, device)
    plan = plan_reference(real)
    expected = AddressSpace.of_tensors(dst_tensors, zero=True)
    execute(plan.descriptors()[0], AddressSpace.of_tensors(src_tensors), expected)

    descs = eager.plan(on_device(real, device)).device_descriptors()
    align = plan_alignment(real)
    if staged:
        offsets, ends = staging_offsets(descs)
        staging = torch.zeros(int(ends[-1]) if len(ends) else 0, dtype=torch.uint8, device=device)
        gather(descs, offsets, staging, align, typical_bytes)
        scatter(descs, offsets, staging, align, typical_bytes)
    else:
        run_direct(descs, align, typical_bytes)
    assert expected.matches(dst_tensors)


def test_alignment_is_a_power_of_two_dividing_every_address(device):
    from kvplan.tools.scenarios import PRESETS, build_batch

    batch = build_batch(PRESETS["llama70b-tp4to8-p64"].scaled(layers=2), 1, 64)
    align = plan_alignment(batch)
    assert align & (align - 1) == 0 and align >= 8
    descs = plan_reference(batch).descriptors()[0]
    assert (descs % np.uint64(align) == 0).all()


@settings(max_examples=examples(15), deadline=None)
@given(scenarios(), st.lists(st.floats(0.0, 1.0), max_size=4), st.sampled_from([16, 4096]))
def test_a_scatter_cut_into_byte_windows_lands_the_same_bytes(device, case, cuts, typical_bytes):
    """Each window of a staged stream, scattered from its own slot with the whole stream's
    descriptors (a wave of a receiver-planned run), lands exactly its bytes; together, every byte."""
    _, batch = case
    real, src_tensors, dst_tensors = _real_batch(batch, device)
    expected = AddressSpace.of_tensors(dst_tensors, zero=True)
    execute(plan_reference(real).descriptors()[0], AddressSpace.of_tensors(src_tensors), expected)
    descs, offsets, align, total, staging = _whole_stream(real, device, typical_bytes)
    bounds = sorted({0, total, *(int(c * total) // align * align for c in cuts)})
    slot = torch.zeros(total + align, dtype=torch.uint8, device=device)  # each window lands at the slot's start
    for lo, hi in zip(bounds, bounds[1:]):
        slot[: hi - lo] = staging[lo:hi]
        scatter(descs, offsets, slot, align, typical_bytes, need=hi - lo, shift=-lo, window=(lo, hi))
    assert expected.matches(dst_tensors)


@settings(max_examples=examples(15), deadline=None)
@given(scenarios(), st.lists(st.floats(0.0, 1.0), max_size=4), st.sampled_from([16, 4096]))
def test_a_gather_ahead_copies_its_window_of_the_counted_rows_only(device, case, cuts, typical_bytes):
    """A gather queued before the host has seen the plan: the descriptor buffer is longer than the
    plan, and the rows past the device count point at poison placed at the window's start. Each
    window, gathered into its own slot, holds exactly its bytes of the whole stream, and nothing
    past the window; with a count of zero (a refused plan) nothing is written."""
    _, batch = case
    real, src_tensors, dst_tensors = _real_batch(batch, device)  # (kept alive: the descriptors point into them)
    descs, offsets, align, total, whole = _whole_stream(real, device, typical_bytes)
    poison = torch.full((4 * align,), 0xFF, dtype=torch.uint8, device=device)
    extra = torch.tensor([[poison.data_ptr(), 0, 4 * align]] * 3, dtype=torch.int64).to(device)
    longer = torch.cat([descs, extra])
    offsets = torch.cat([offsets, torch.zeros(3, dtype=torch.int64, device=device)])
    counted = torch.tensor([descs.shape[0]], dtype=torch.int64).to(device)
    bounds = sorted({0, total, *(int(c * total) // align * align for c in cuts)})
    for lo, hi in zip(bounds, bounds[1:]):
        slot = torch.zeros(hi - lo + 4 * align, dtype=torch.uint8, device=device)
        gather(longer, offsets, slot, align, typical_bytes, need=hi - lo, shift=-lo, window=(lo, hi), rows=counted)
        assert torch.equal(slot[: hi - lo], whole[lo:hi]) and not slot[hi - lo :].any()
    slot = torch.zeros(max(total, 4 * align), dtype=torch.uint8, device=device)
    gather(longer, offsets, slot, align, typical_bytes, need=total, window=(0, total), rows=counted * 0)
    assert not slot.any()


@settings(max_examples=examples(10), deadline=None)
@given(scenarios(), st.sampled_from([16, 4096]))
def test_a_counted_scatter_lands_the_counted_rows_only(device, case, typical_bytes):
    """A scatter over a descriptor buffer longer than the plan, counted on the device: the plan's
    rows land every byte; the rows past the count point at a guard that stays zero; a count of
    zero writes nothing."""
    _, batch = case
    real, src_tensors, dst_tensors = _real_batch(batch, device)
    expected = AddressSpace.of_tensors(dst_tensors, zero=True)
    execute(plan_reference(real).descriptors()[0], AddressSpace.of_tensors(src_tensors), expected)
    descs, offsets, align, total, staging = _whole_stream(real, device, typical_bytes)
    guard = torch.zeros(4 * align, dtype=torch.uint8, device=device)
    longer = torch.cat([descs, torch.tensor([[0, guard.data_ptr(), 4 * align]] * 3, dtype=torch.int64).to(device)])
    offsets = torch.cat([offsets, torch.zeros(3, dtype=torch.int64, device=device)])
    for t in dst_tensors:
        t.zero_()
    scatter(longer, offsets, staging, align, typical_bytes, need=total, rows=torch.zeros(1, dtype=torch.int64).to(device))
    assert not any(t.any() for t in dst_tensors) and not guard.any()
    scatter(longer, offsets, staging, align, typical_bytes, need=total,
            rows=torch.tensor([descs.shape[0]], dtype=torch.int64).to(device))
    assert expected.matches(dst_tensors) and not guard.any()

