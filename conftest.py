"""Test set-up for tests/ and benchmarks/: kernels run in Triton's interpreter unless TRITON_INTERPRET=0 is exported.

The variable must be set before any module that defines kernels is imported.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# tests move bytes on loopback only, by their own choice (the library picks no network): UCX's devices
os.environ.setdefault("UCX_NET_DEVICES", "lo")
# and Mooncake's transport inside SGLang (kvplan's adapter takes SGLang's MOONCAKE_PROTOCOL, rdma when unset)
os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")

# control channels on loopback prove this user's loopback secret (kvplan.transport.auth): the tests' own, in a
# private folder made for the run (the workers and every process they start inherit it), not the user's
if "KVPLAN_LOOPBACK_SECRET_FILE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _secret_folder = tempfile.mkdtemp(prefix="kvplan-tests-")
    os.environ["KVPLAN_LOOPBACK_SECRET_FILE"] = os.path.join(_secret_folder, "loopback-secret")
    atexit.register(shutil.rmtree, _secret_folder, True)

import pytest  # noqa: E402
import torch  # noqa: E402

from kvplan.tools import target_process  # noqa: E402

# the tests' child processes are forked from a server that has imported SGLang too (tests/preload.py)
target_process.PRELOAD.append("tests.preload")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """``cuda`` on a GPU run (TRITON_INTERPRET=0 and a GPU present), otherwise ``cpu``."""
    if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")
