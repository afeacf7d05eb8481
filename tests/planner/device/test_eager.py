"""The GPU planner against the NumPy reference: bit-identical plans, the same errors.

Runs in Triton's interpreter on the CPU (CI) and on CUDA with TRITON_INTERPRET=0.
"""

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvplan.errors import PlanError
from kvplan.planner.device import eager
from kvplan.planner.contract.batch import Batch, SideMemory, StateComponent
from kvplan.planner.contract.pairing import Mode
from kvplan.planner.device.prepared import prepared_indices_reference
from kvplan.planner.reference.oracle import plan_reference
from kvplan.tools.scenarios import PRESETS, build_batch
from tests.kernels.order import shuffled_program_order
from tests.planner.reference.test_properties import scenarios
from tests.draws import examples


def on_device(batch: Batch, device: torch.device) -> Batch:
    return batch.to(device)


def check_same(batch: Batch, device: torch.device, block: int = 1024) -> None:
    try:
        expected = plan_reference(batch)
    except PlanError as err:
        with pytest.raises(type(err)) as raised:
            eager.plan(on_device(batch, device), block=block).result()
        assert raised.value.request == err.request, f"{raised.value} vs {err}"
        return
    direct = all(t.mode is Mode.DIRECT for t in expected.transfers)
    pending = eager.plan(on_device(batch, device), block=block, prepared=direct)
    pending.result().assert_equal(expected)
    if direct:
        pending.prepared_indices().assert_equal(prepared_indices_reference(batch, expected))
    descs, offsets = pending.descriptors()
    want_descs, want_offsets = expected.descriptors()
    assert descs.dtype == np.uint64 and np.array_equal(descs, want_descs)
    assert np.array_equal(offsets, want_offsets)
    assert pending.sections() == expected.sections()  # from the segment sums, with no plan assembled


@settings(max_examples=examples(40), deadline=None)
@given(scenarios(), st.sampled_from([16, 1024]))
def test_direct_plans_match_the_reference(device, case, block):
    check_same(case[1], device, block)


@settings(max_examples=examples(20), deadline=None)
@given(scenarios(head_sliced=True), st.sampled_from([16, 1024]))
def test_head_sliced_plans_match_the_reference(device, case, block):
    check_same(case[1], device, block)


@settings(max_examples=examples(15), deadline=None)
@given(scenarios(), st.integers(0, 3))
def test_plans_do_not_depend_on_program_order(device, case, seed):
    if device.type != "cpu":
        pytest.skip("program order is shuffled in the interpreter only")
    with shuffled_program_order(seed):
        check_same(case[1], device, block=16)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_model_presets_match_the_reference(device, preset):
    """Lists longer than one program's block, every state kind, chunked, with a decode prefix."""
    batch = build_batch(PRESETS[preset].scaled(layers=2), requests=3, prompt_len=[300, 129, 1000], chunks=2,
                        prefix_len=64, seed=7)
    check_same(batch, device, block=128)


@pytest.fixture
def int32_sanitizer(device):
    """The interpreter's debug mode: int32 overflow in kernel arithmetic raises instead of wrapping."""
    if device.type != "cpu":
        pytest.skip("the sanitizer exists in the interpreter only")
    from triton.runtime import interpreter

    saved = interpreter.interpreter_builder.options
    interpreter.interpreter_builder.options = interpreter.InterpreterOptions(debug=True)
    yield
    interpreter.interpreter_builder.options = saved


def test_large_addresses_and_page_ids_use_64_bit_arithmetic(device, int32_sanitizer):
    from kvplan.planner.contract.batch import Attention, Entry, KVLayout, StateKind, Transfer

    ps, item, pages = 64, 16384, (1 << 25) - 1  # page * item needs 39 bits; slots stay below 2**31
    kv = lambda base: KVLayout(Attention.MHA, ps, tuple(Entry(base + (i << 45), item, pages + 1) for i in range(4)))  # noqa: E731
    table = np.zeros((2, 256), np.int32)
    for k, page in enumerate([pages - 2, pages - 1, pages, 7]):
        table[1, k * ps : (k + 1) * ps] = page * ps + np.arange(ps)
    ring = lambda base: StateComponent(StateKind.SWA_RING, (Entry(base, 1 << 20, 1 << 12),), window=32, ring_size=2048)  # noqa: E731
    src = SideMemory(kv(0x7F00_0000_0000_0000), (ring(0x7E00_0000_0000_0000),), (), table)
    dst = SideMemory(kv(0x7D00_0000_0000_0000), (ring(0x7C00_0000_0000_0000),))
    t = Transfer("big", 1, 0, 257, 256, True, np.array([pages, pages - 1, 3, 4]), dst_state=(np.arange(32) + 2048,))
    check_same(Batch(src, (dst,), (t,)), device)


def _mutate(batch: Batch, kind: str, which: int):
    """One bad transfer in an otherwise valid batch: ``(batch, error types, request)``, or ``None``
    when the mutation does not apply to the drawn transfer (then it could be valid)."""
    from dataclasses import replace

    from kvplan.errors import (AlignmentError, AllocatorInvariantError, InputError, LengthMismatchError,
                               PoolBoundsError)
    from kvplan.planner.contract.batch import Policy
    from kvplan.planner.contract.rules import cdiv, chunk_end

    transfers = list(batch.transfers)
    i = which % len(transfers)
    t = transfers[i]
    ps = batch.src.kv.page_size
    strict = batch.policy is Policy.STRICT
    end = chunk_end(t.start, t.fill_len, t.prompt_len, ps, t.last)
    pages = cdiv(end - t.start, ps)
    out = None
    if kind == "unaligned" and ps > 1:
        out = replace(t, start=t.start + 1), (AlignmentError,)
    elif kind == "dst_out_of_pool" and t.last and pages:
        dst = t.dst_pages.copy()
        dst[-1] = batch.dsts[0].kv.num_pages + 3
        out = replace(t, dst_pages=dst), (PoolBoundsError,)
    elif kind == "dst_short" and t.last and pages and strict:
        out = replace(t, dst_pages=t.dst_pages[:-1]), (LengthMismatchError,)
    elif kind == "wrong_last" and not t.last and strict and (
            cdiv(min(t.fill_len, t.prompt_len) - t.prefix_len, ps) < cdiv(t.prompt_len - t.prefix_len, ps)):
        out = replace(t, last=True), (LengthMismatchError,)  # claims the end while destination pages remain
    elif kind == "bad_row":
        out = replace(t, src_row=0), (InputError,)
    elif kind == "bad_aux" and t.last and batch.src.aux:
        out = replace(t, aux_dst=10**6), (PoolBoundsError,)
    elif kind == "state_short" and t.last and strict and t.dst_state and len(t.dst_state[0]) > 1:
        out = replace(t, dst_state=(t.dst_state[0][:-1], *t.dst_state[1:])), (LengthMismatchError,)
    elif kind == "src_slot" and pages:
        table = batch.src.req_to_token.copy()
        table[t.src_row, t.start] = (batch.src.kv.num_pages + 5) * ps
        bad = Batch(replace(batch.src, req_to_token=table), batch.dsts, tuple(transfers), batch.policy)
        return bad, (AllocatorInvariantError, PoolBoundsError), t.request
    if out is None:
        return None
    transfers[i] = out[0]
    return Batch(batch.src, batch.dsts, tuple(transfers), batch.policy), out[1], t.request


@settings(max_examples=examples(40), deadline=None)
@given(scenarios(), st.sampled_from(["unaligned", "dst_out_of_pool", "dst_short", "wrong_last", "bad_row", "bad_aux",
                                     "state_short", "src_slot"]), st.integers(0, 50))
def test_bad_batches_raise_what_the_reference_raises(device, case, kind, which):
    """Every mutation that must fail fails, on both paths, with its error type and the bad request."""
    mutated = _mutate(case[1], kind, which)
    assume(mutated is not None)
    batch, types, request = mutated
    with pytest.raises(types) as by_reference:
        plan_reference(batch)
    assert by_reference.value.request == request
    with pytest.raises(type(by_reference.value)) as on_device_:
        eager.plan(on_device(batch, device)).result()
    assert on_device_.value.request == request, f"{on_device_.value} vs {by_reference.value}"
