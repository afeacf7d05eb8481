"""Fetch vLLM 0.33.0's own KV-connector unit tests from its source distribution (pinned by URL and
sha256), into a folder of its own: ``python tests/integrations/vllm_suite/fetch_vllm_tests.py DEST``.

Only what those tests import of vLLM's test tree is extracted (``tests/__init__.py``,
``tests/v1/__init__.py``, ``tests/v1/kv_connector/``); the tests are run from there as vLLM ships
them, with kvplan's connector in place of NIXL's (``kvplan_vllm_plugin.py``).
"""

from __future__ import annotations

import hashlib
import io
import sys
import tarfile
import urllib.request
from pathlib import Path

URL = ("https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/"
       "vllm-0.33.0.tar.gz")
SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
KEEP = ("vllm-0.33.0/tests/__init__.py", "vllm-0.33.0/tests/v1/__init__.py", "vllm-0.33.0/tests/v1/kv_connector/")


def main(dest: str) -> None:
    with urllib.request.urlopen(URL, timeout=300) as response:
        data = response.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"vllm-0.33.0.tar.gz: sha256 {digest}, expected {SHA256}")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(KEEP) and (m.isfile() or m.isdir())]
        archive.extractall(dest, members=members, filter="data")
    print(f"vLLM 0.33.0's connector tests: {sum(m.isfile() for m in members)} files in {Path(dest) / 'vllm-0.33.0'}")


if __name__ == "__main__":
    main(sys.argv[1])
