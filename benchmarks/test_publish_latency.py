"""pytest-benchmark: decode-side publication, kvplan against the SGLang-style path (messages equal)."""

import os

import pytest
import torch

from benchmarks.publish_latency import PRESET_NAMES, decode_side, kvplan_messages, sglang_style_messages

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0"


@pytest.fixture(scope="module", params=PRESET_NAMES)
def decode_batch(request):
    return decode_side(request.param, 64 if ON_GPU else 2, torch.device("cuda" if ON_GPU else "cpu"))


@pytest.mark.parametrize("publish", [kvplan_messages, sglang_style_messages], ids=["kvplan", "sglang-style"])
def test_publish_latency(benchmark, decode_batch, publish):
    side, requests = decode_batch
    messages = benchmark(publish, side, requests)
    other = sglang_style_messages if publish is kvplan_messages else kvplan_messages
    assert messages == other(side, requests)
