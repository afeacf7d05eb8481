"""The vLLM harness's import chain as a card runs it: vLLM's CUDA platform selected, its compiled extensions
not loadable (the card's archive carries none: ``benchmarks/vllm_site.py``; here there is no driver).

On the first card run every row of ``python -m benchmarks vllm-backends`` failed at import, in both
processes: ``allocate_kv_cache``'s chain reached ``vllm.vllm_flash_attn``, which raises without its
extensions, then import-time capability checks of vLLM's kernel library (``torch.ops._C``). The CPU runs
never take that path (``VLLM_TARGET_DEVICE=cpu``): this test does, in a process of its own.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed (make setup-vllm)")

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]

# vLLM's CUDA platform, as the card's process gets it (NVML finds the card there): its device queries answered
# as an A100's, since no driver answers here; its kernel library stands in as on the card, where it is absent
CARD_PROCESS = """
import os, sys, types
sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
import vllm.platforms as platforms
from vllm.platforms.cuda import CudaPlatform
from vllm.platforms.interface import DeviceCapability
platform = CudaPlatform()
type(platform).get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(8, 0))
type(platform).get_device_name = classmethod(lambda cls, device_id=0: "a card")
platforms.current_platform = platform
os.environ["VLLM_TARGET_DEVICE"] = "cuda"  # (what benchmarks/vllm_backends.py sets for --device cuda)
import tests.integrations.vllm_node as node
from vllm.platforms import current_platform
assert current_platform.is_cuda(), current_platform
print("imported", type(current_platform).__name__)
"""


def test_the_harness_imports_with_vllm_s_cuda_platform_and_no_compiled_extension():
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    done = subprocess.run([sys.executable, "-c", CARD_PROCESS], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-4000:]
