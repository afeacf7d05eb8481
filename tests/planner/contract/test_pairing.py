"""What a pairing says before any batch: the smallest KV descriptor it makes (a staged send's first
gather is shaped for it), checked against the reference planner's descriptors."""

import pytest

from kvplan.planner.contract.pairing import smallest_descriptor
from kvplan.planner.contract.plan import KV_ROLE
from kvplan.planner.reference.oracle import plan_reference
from kvplan.tools.scenarios import PRESETS, build_batch


@pytest.mark.parametrize("preset, expected", [("llama70b-tp8-p64", 64 * 256), ("llama70b-tp4to8-p64", 256)])
def test_the_smallest_descriptor_is_a_page_of_one_layer_or_one_tokens_head_slice(preset, expected):
    batch = build_batch(PRESETS[preset].scaled(layers=2), 4, 1024, chunks=2, seed=3)
    smallest = smallest_descriptor(batch.src, batch.dsts)
    assert smallest == expected
    plan = plan_reference(batch)
    descs = plan.descriptors()[0]
    kv = [int(d[2]) for s in plan.sections() if s.role == KV_ROLE for d in descs[s.lo : s.hi]]
    assert kv and min(kv) >= smallest and all(size % smallest == 0 for size in kv)
