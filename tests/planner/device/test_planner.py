"""The planner object on array-in columns: the same plans, errors and output forms as the reference."""

import numpy as np
import pytest
import torch

from kvplan.errors import InputError, LengthMismatchError
from kvplan.tools.host_baselines import NumpyBatchPlanner, prepared_ids
from kvplan.planner.device.columns import BatchColumns
from kvplan.planner.device.planner import Planner
from kvplan.planner.contract.batch import Batch, Transfer
from kvplan.planner.device.prepared import prepared_indices_reference
from kvplan.planner.reference.oracle import plan_reference
from kvplan.tools.scenarios import PRESETS, build_batch
from tests.planner.builders import mha_side, table_with


@pytest.mark.parametrize("preset, variant", [("gptoss-swa-p16", False), ("qwen3next-mamba-p64", False),
                                             ("dsv32-mla-dsa-p64", False), ("gptoss-swa-p16", True),
                                             ("dsv32-mla-dsa-p64", True)])
def test_columns_plan_like_the_reference_in_every_form(device, preset, variant):
    """``variant``: SWA and DSA lists from the decode prefix (planning.md §6's ``from_prefix``)."""
    shape = PRESETS[preset].scaled(layers=2)
    batch = build_batch(shape.from_prefix() if variant else shape, requests=3, prompt_len=[300, 129, 1000], chunks=2,
                        prefix_len=64, seed=3).to(device)
    planner = Planner(batch.src, batch.dsts, outputs=("descriptors", "prepared", "runs", "byte_offsets"), block=128)
    cols = BatchColumns.from_batch(batch)
    pending = planner.plan(cols)
    expected = plan_reference(batch)
    pending.result().assert_equal(expected)
    descs, offsets = pending.descriptors()
    want, want_offsets = expected.descriptors()
    assert np.array_equal(descs, want) and np.array_equal(offsets, want_offsets)
    # staged mode's forms: byte offsets on the device, the sections' byte ends in the report, and the
    # buffer with its count on the device (read before the host has waited)
    ends = np.cumsum(want[:, 2].astype(np.int64))
    assert np.array_equal(pending.device_byte_offsets().cpu().numpy(), ends - want[:, 2].astype(np.int64))
    sections = pending.sections()
    assert [(s.request, s.role, s.lo, s.hi) for s in sections] == \
        [(s.request, s.role, s.lo, s.hi) for s in expected.sections()]
    assert np.array_equal(pending.section_byte_ends(), [int(ends[s.hi - 1]) for s in sections] + [int(ends[-1])])
    ahead = pending.device_ahead()
    assert int(ahead.rows) == len(want)
    assert np.array_equal(ahead.descs[: len(want)].cpu().numpy().view(np.uint64), want)
    assert np.array_equal(ahead.byte_offsets[: len(want)].cpu().numpy(), ends - want[:, 2].astype(np.int64))
    pending.prepared_indices().assert_equal(prepared_indices_reference(batch, expected))
    host = NumpyBatchPlanner(batch.src, batch.dsts)
    compact = pending.runs()
    assert np.array_equal(compact.runs, host.runs(cols)[0])
    assert np.array_equal(_expand_compact(compact), want)
    assert np.array_equal(host.plan(cols)[0], want)
    src_ids, dst_ids = prepared_ids(batch.src, batch.dsts, cols)
    assert np.array_equal(src_ids, pending.prepared_indices().src) and np.array_equal(dst_ids,
                                                                                    pending.prepared_indices().dst)


@pytest.mark.parametrize("preset, dst_page_size", [("llama70b-tp8-p64", 16), ("llama70b-tp8-p64", 256),
                                                   ("llama70b-tp8-p64", 1), ("qwen3next-mamba-p64", 16),
                                                   ("dsv32-mla-dsa-p64", 16), ("dsv32-mla-dsa-p64", 1),
                                                   ("gptoss-swa-p16", 64), ("gptoss-swa-p16", 1),
                                                   ("dsv32-mla-dsa-p64+", 16), ("gptoss-swa-p16+", 64)])
def test_a_decode_side_of_another_page_size_plans_alike_in_descriptors_runs_and_numpy_batch(device, preset,
                                                                                           dst_page_size):
    """docs/page_sizes.md: 64 -> 16, 64 -> 256 and 64 -> 1, chunked on the grain, with a decode prefix;
    Mamba state, whose lists do not depend on the page size, and DSA and SWA state in units, with it
    (``+``: their lists from the decode prefix, planning.md §6's ``from_prefix``)."""
    shape = PRESETS[preset.rstrip("+")].scaled(layers=2)
    batch = build_batch(shape.from_prefix() if preset.endswith("+") else shape, requests=3,
                        prompt_len=[300, 129, 1000], chunks=2, prefix_len=256, seed=5,
                        dst_page_size=dst_page_size).to(device)
    planner = Planner(batch.src, batch.dsts, outputs=("descriptors", "runs"), block=128)
    cols = BatchColumns.from_batch(batch)
    pending = planner.plan(cols)
    expected = plan_reference(batch)
    pending.result().assert_equal(expected)
    want = expected.descriptors()[0]
    assert np.array_equal(pending.descriptors()[0], want)
    host = NumpyBatchPlanner(batch.src, batch.dsts)
    compact = pending.runs()
    assert np.array_equal(compact.runs, host.runs(cols)[0])
    assert np.array_equal(_expand_compact(compact), want)
    assert np.array_equal(host.plan(cols)[0], want)
    # with no descriptors made, the plan's descriptors are expanded on the host from its unit runs
    Planner(batch.src, batch.dsts, outputs=("runs",), block=128).plan(cols).result().assert_equal(expected)


def _expand_compact(compact):
    """Entry x run expansion of the compact form as an engine would write it (direct mode)."""
    out = []
    for s in range(len(compact.segment_runs) - 1):
        first, count = compact.entry_span[s]
        runs = compact.runs[compact.segment_runs[s] : compact.segment_runs[s + 1]].astype(np.uint64)
        for src_base, dst_base, src_item, dst_item, per_item in compact.entries[first : first + count]:
            out += [(src_base + s0 * src_item, dst_base + d0 * dst_item, n * per_item) for s0, d0, n in runs]
    return np.array(out, dtype=np.uint64).reshape(-1, 3)


def _side_and_columns(device, dst_pages, counts):
    src = mha_side(0x1000_0000, page_size=4, table=torch.from_numpy(table_with({1: [5, 6, 9], 2: [7, 8]}, 4)).to(device))
    dst = mha_side(0x9000_0000, page_size=4)
    cols = BatchColumns.build(src_row=[1, 2], start=[0, 0], fill_len=[13, 9], prompt_len=[12, 8], last=[1, 1],
                              dst_pages=np.array(dst_pages), dst_page_counts=counts, requests=["a", "b"])
    return src, dst, cols


def test_an_error_in_columns_names_its_request_and_nothing_is_returned(device):
    src, dst, cols = _side_and_columns(device, [3, 4, 10, 11], [3, 1])  # "b" needs 2 pages, has 1
    pending = Planner(src, [dst], outputs=("descriptors", "byte_offsets")).plan(cols)
    assert int(pending.device_ahead().rows) == 0  # a gather queued ahead reads nothing of it
    with pytest.raises(LengthMismatchError) as raised:
        pending.descriptors()
    assert raised.value.request == "b"


def test_columns_equal_the_batch_they_describe(device):
    src, dst, cols = _side_and_columns(device, [3, 4, 10, 11, 12], [3, 2])
    batch = Batch(src, (dst,), (Transfer("a", 1, 0, 13, 12, True, np.array([3, 4, 10])),
                                Transfer("b", 2, 0, 9, 8, True, np.array([11, 12]))))
    got = Planner(src, [dst]).plan(cols).result()
    got.assert_equal(plan_reference(batch))
    assert got.transfers[0].runs.tolist() == [[5, 3, 2], [9, 10, 1]]


def test_bad_columns_are_refused_at_once():
    with pytest.raises(InputError, match="dst_page_counts"):
        BatchColumns.build(src_row=[1], start=[0], fill_len=[5], prompt_len=[4], last=[1],
                           dst_pages=np.array([1, 2]), dst_page_counts=[1])
    with pytest.raises(InputError, match="integer"):
        BatchColumns.build(src_row=[1.5], start=[0], fill_len=[5], prompt_len=[4], last=[1],
                           dst_pages=np.array([1]), dst_page_counts=[1])


def test_a_warmed_up_planner_plans_like_the_reference(device):
    """Warm-up plans empty batches into every bucket; a real batch after it is planned exactly (the
    claim bitmap and buffers the empty plans touched are left as a fresh planner's)."""
    batch = build_batch(PRESETS["qwen3next-mamba-p64"].scaled(layers=2), requests=3, prompt_len=[300, 129, 1000],
                        chunks=2, seed=5).to(device)
    planner = Planner(batch.src, batch.dsts, outputs=("descriptors", "byte_offsets"), block=128)
    ready = planner.warm_up(max_transfers=6, elements_per_transfer=40)
    assert ready == (3 if device.type == "cuda" else 0)  # one transfer bucket of 64, 128, 256 elements; none off a GPU
    pending = planner.plan(BatchColumns.from_batch(batch))
    expected = plan_reference(batch)
    pending.result().assert_equal(expected)
    assert np.array_equal(pending.descriptors()[0], expected.descriptors()[0])
    with pytest.raises(InputError, match="at least one transfer"):
        planner.warm_up(max_transfers=0, elements_per_transfer=8)
