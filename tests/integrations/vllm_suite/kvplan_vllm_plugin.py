"""A pytest plugin that runs vLLM 0.33.0's own KV-connector lifecycle tests with kvplan's connector in
place of ``NixlConnector`` (``make test-vllm``; docs/vllm.md lists what runs and what does not).

vLLM's tests build every configuration through ``tests/v1/kv_connector/unit/utils.create_vllm_config``,
whose connector defaults to ``NixlConnector``: the plugin gives that default to
``KvplanConnector`` (``kvplan.integrations.vllm``), and the model to a local copy of
``facebook/opt-125m``'s configuration (no download). Every collected test runs, none is expected to
fail.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest

# facebook/opt-125m's configuration (its published config.json): the tests read the model's shape only
OPT_125M = {"architectures": ["OPTForCausalLM"], "model_type": "opt", "vocab_size": 50272, "hidden_size": 768,
            "num_hidden_layers": 12, "ffn_dim": 3072, "num_attention_heads": 12, "max_position_embeddings": 2048,
            "word_embed_proj_dim": 768, "do_layer_norm_before": True, "activation_function": "relu",
            "torch_dtype": "float16", "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2, "enable_bias": True,
            "layer_norm_elementwise_affine": True}

def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cpu_test: vLLM's marker of tests that run on a CPU")
    model = Path(tempfile.mkdtemp(prefix="kvplan-opt-125m-"))
    (model / "config.json").write_text(json.dumps(OPT_125M))
    import tests.v1.kv_connector.unit.utils as vllm_test_utils

    made = vllm_test_utils.create_vllm_config

    @functools.wraps(made)
    def with_kvplan(*args, **kwargs):
        kwargs.setdefault("model", str(model))
        if kwargs.get("kv_connector", "NixlConnector") == "NixlConnector":
            kwargs["kv_connector"] = "KvplanConnector"
            kwargs["kv_connector_module_path"] = "kvplan.integrations.vllm"
        return made(*args, **kwargs)

    vllm_test_utils.create_vllm_config = with_kvplan
    _count_connectors()


_built: list[int] = [0]  # KvplanConnector objects made during the current test


def _count_connectors() -> None:
    from kvplan.integrations.vllm.connector import KvplanConnector

    made = KvplanConnector.__init__

    @functools.wraps(made)
    def counted(self, *args, **kwargs):
        _built[0] += 1
        made(self, *args, **kwargs)

    KvplanConnector.__init__ = counted


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """A test that never built kvplan's connector did not test it: it fails (a test of vLLM's that mocks
    the connector away belongs to no run of this plugin)."""
    _built[0] = 0
    result = yield
    if _built[0] == 0:
        raise AssertionError(f"{item.name} made no KvplanConnector: it does not test kvplan's connector")
    return result


def pytest_report_header(config: pytest.Config) -> str:
    return "vLLM 0.33.0's own connector tests, with kvplan's connector in place of NixlConnector"
