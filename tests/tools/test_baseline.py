"""The SGLang-style baseline plans what kvplan plans (direct mode, every state type), so that
benchmarks compare equal work."""

import numpy as np
from hypothesis import given, settings

from kvplan.tools.baseline import sglang_style_descs
from kvplan.planner.reference.oracle import plan_reference
from tests.planner.reference.test_properties import scenarios


@settings(max_examples=40, deadline=None)
@given(scenarios() | scenarios(head_sliced=True))
def test_baseline_descriptors_equal_the_reference(case):
    _, batch = case
    assert np.array_equal(sglang_style_descs(batch), plan_reference(batch).descriptors()[0])
