"""kvplan installs as the README says, from the wheel ``make dist`` builds, into a fresh environment,
and the README's first snippet runs there (the kernels interpreted: torch's CPU build).

The fresh environment gets torch's CPU build first (the README's CPU-only line, from this machine's
package index), then the wheel, whose own dependencies pip resolves within pyproject's bounds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

pytestmark = pytest.mark.install


def _readme_install_lines() -> list[str]:
    """The commands of the README's install block (between its markers)."""
    text = README.read_text()
    block = text[text.index("<!-- install -->"):text.index("<!-- end of install -->")]
    return [line for line in re.findall(r"^(pip install .*)$", block, re.M)]


def test_the_readme_s_install_lines_name_the_wheel_make_dist_builds_and_a_cpu_torch():
    lines = _readme_install_lines()
    assert any("torch==2.13.0+cpu" in line for line in lines), lines
    assert any("dist/kvplan-0.1.0-py3-none-any.whl" in line for line in lines), lines


def test_the_wheel_installs_into_a_fresh_environment_and_the_first_snippet_runs_there(tmp_path):
    subprocess.run(["make", "--no-print-directory", "-s", "dist"], cwd=ROOT, check=True, timeout=300,
                   capture_output=True)
    wheels = sorted((ROOT / "dist").glob("kvplan-*.whl"))
    assert len(wheels) == 1, wheels
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)  # (this pip installs into it: --python)
    python = str(env_dir / "bin" / "python")
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-compile",
           "--disable-pip-version-check"]
    for line in _readme_install_lines():  # the README's lines, with its index option left to this machine's pip
        words = line.split("#")[0].split()[2:]
        if "--index-url" in words:
            at = words.index("--index-url")
            del words[at:at + 2]
        words = [str(wheels[0]) + w[len("dist/kvplan-0.1.0-py3-none-any.whl"):] if w.startswith("dist/") else w
                 for w in (w.strip('"') for w in words)]
        done = subprocess.run(pip + words, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr[-3000:]}"
    snippet = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["TRITON_INTERPRET"] = "1"  # a library user on a CPU chooses the interpreter (the CLI does it itself)
    done = subprocess.run([python, "-c", snippet], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.split() == "[[16 3 2] [18 9 2]]".split(), done.stdout
    where = subprocess.run([python, "-c", "import kvplan; print(kvplan.__file__)"], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=60)
    assert str(env_dir) in where.stdout, where.stdout  # kvplan from the wheel, not from this checkout
