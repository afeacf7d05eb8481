"""The engines' own environments (tests/engine_env.py): kvplan's wheel installed by pip's resolver beside the
engine, with the torch and triton the engine pins. These run inside each environment (``make test-sglang``,
``make test-vllm``); elsewhere the engine is absent and they skip."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.engine_env import ENGINES, exact_pins


def _installed(distribution: str) -> bool:
    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


ENGINE_MARKS = {"sglang": pytest.mark.sglang, "vllm": pytest.mark.vllm}


@pytest.mark.parametrize("engine", [pytest.param(name, marks=ENGINE_MARKS[name]) for name in ENGINES])
def test_the_environment_holds_the_engine_s_torch_and_kvplan_s_wheel(engine):
    name, version = ENGINES[engine].requirement.split("==")
    if not _installed(name):
        pytest.skip(f"{name} is not installed here (its environment: make setup-{engine})")
    assert metadata.version(name) == version
    import torch
    import triton

    pins = exact_pins(metadata.requires(name) or [])
    assert torch.__version__.split("+")[0] == pins["torch"], (torch.__version__, pins["torch"])
    if "triton" in pins:
        assert triton.__version__ == pins["triton"]
    # kvplan came from its wheel (a regular install into this environment's site-packages, not this
    # checkout's editable one, whose metadata lies beside the checkout's modules on the path)
    site = sysconfig.get_paths()["purelib"]
    kvplan = next(metadata.distributions(name="kvplan", path=[site]))
    direct = kvplan.read_text("direct_url.json")
    assert direct is not None and json.loads(direct).get("dir_info", {}).get("editable") is not True, direct
    assert direct is not None and json.loads(direct)["url"].endswith(".whl"), direct
    # ... and the environment is the resolution of kvplan's wheel beside the engine (tests/engine_env.py)
    from tests.engine_env import compiled_pins

    resolved = compiled_pins((Path(sys.prefix) / "resolved.txt").read_text())
    assert resolved[name] == version and resolved["torch"] == pins["torch"], {k: resolved.get(k) for k in (name, "torch")}
