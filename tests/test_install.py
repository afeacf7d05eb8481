"""kvplan installs as the README says, from the wheel ``make dist`` builds, into a fresh environment,
and the README's first snippet runs there (the kernels interpreted: torch's CPU build).

The fresh environment gets torch's CPU build first (the README's CPU-only line, from this machine's
package index), then the wheel, whose own dependencies pip resolves within pyproject's bounds."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
WHEEL_NAME = "dist/kvplan-0.1.0-py3-none-any.whl"
# every document with an install block, and the engines its extras must make importable
DOCUMENTS = {"README.md": ("ipc",), "docs/sglang.md": ("nixl", "mooncake"), "docs/vllm.md": ("nixl", "mooncake")}
EXTRA_ENGINES = {"ipc": "ipc", "nixl": "nixl", "mooncake": "mooncake"}

pytestmark = pytest.mark.install


def _install_lines(document: str) -> list[str]:
    """The commands of a document's install block (between its markers)."""
    text = (ROOT / document).read_text()
    block = text[text.index("<!-- install -->"):text.index("<!-- end of install -->")]
    return [line for line in re.findall(r"^\s*(pip install .*)$", block, re.M)]


def _readme_install_lines() -> list[str]:
    return _install_lines("README.md")


def test_the_readme_s_install_lines_name_the_wheel_make_dist_builds_and_a_cpu_torch():
    lines = _readme_install_lines()
    assert any("torch==2.13.0+cpu" in line for line in lines), lines
    assert any(WHEEL_NAME in line for line in lines), lines


@pytest.mark.parametrize("document", sorted(DOCUMENTS))
def test_every_install_line_names_the_wheel_with_an_engine_s_extra(document):
    lines = [line for line in _install_lines(document) if WHEEL_NAME in line]
    assert lines, document
    named = {extra for line in lines for extra in re.findall(r"\.whl\[([a-z0-9-]+)\]", line)}
    assert set(DOCUMENTS[document]) <= named, (document, named)


def test_the_sglang_plugin_s_docstring_shows_docs_sglang_s_install_line():
    from kvplan.integrations.sglang import plugin

    def command(line: str) -> str:
        return line.split("#")[0].strip()

    shown = re.findall(r"^\s*(pip install .*)$", plugin.__doc__, re.M)
    assert shown and set(map(command, shown)) <= set(map(command, _install_lines("docs/sglang.md"))), shown


def _fresh_environment(tmp_path: Path) -> tuple[str, list[str]]:
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)  # (this pip installs into it: --python)
    python = str(env_dir / "bin" / "python")
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-compile",
           "--disable-pip-version-check"]
    return python, pip


def _wheel(tmp_path: Path) -> Path:
    """The wheel ``make dist`` builds, copied for this test: tests on other workers build it too, one at a time
    (``make dist`` empties dist/ and build/ first)."""
    with open(ROOT / "dist.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(["make", "--no-print-directory", "-s", "dist"], cwd=ROOT, check=True, timeout=300,
                       capture_output=True)
        wheels = sorted((ROOT / "dist").glob("kvplan-*.whl"))
        assert len(wheels) == 1, wheels
        return Path(shutil.copy(wheels[0], tmp_path))


def _run_line(pip: list[str], line: str, wheel: Path) -> None:
    """One of a document's ``pip install`` lines, with its index option left to this machine's pip."""
    words = line.split("#")[0].split()[2:]
    if "--index-url" in words:
        at = words.index("--index-url")
        del words[at:at + 2]
    words = [str(wheel) + w[len(WHEEL_NAME):] if w.startswith("dist/") else w for w in (w.strip('"') for w in words)]
    done = subprocess.run(pip + words, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr[-3000:]}"


def _clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}


def test_every_document_s_install_lines_run_in_one_fresh_environment_and_what_they_install_imports(tmp_path):
    """One fresh environment, as a user builds it, step by step: the CPU torch (the README's first line), the
    plain wheel (it plans; its transport names the extra it lacks), then the README's line (its first snippet
    runs there, kvplan from the wheel) and each engine document's lines, each followed by kvplan's own check
    that the engines its extras name import (``missing_engine``). An engine's environment holds its own
    torch; here the CPU torch stands for it."""
    wheel = _wheel(tmp_path)
    python, pip = _fresh_environment(tmp_path)
    env = _clean_environ()
    env["TRITON_INTERPRET"] = "1"  # a library user on a CPU chooses the interpreter (the CLI does it itself)
    torch_line, *readme_lines = _readme_install_lines()
    _run_line(pip, torch_line, wheel)
    # the plain wheel: no extra, so no pyzmq
    _run_line(pip, f"pip install {WHEEL_NAME}", wheel)
    code = ("import kvplan.transport.engines as e\n"
            "from kvplan.transport.engines.registry import missing_engine\n"
            "print(missing_engine('ipc'))\n"
            "from kvplan.transport.control import ControlChannel\n"
            "ControlChannel(host='127.0.0.1')\n")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 1
    assert "ipc is not installed here" in done.stdout and "extra ipc" in done.stdout, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kvplan.transport.zmq_import.MissingExtra: kvplan's transport needs pyzmq"), last
    assert "[ipc]" in last, last
    # the README's line, and its first snippet
    for line in readme_lines:
        _run_line(pip, line, wheel)
    snippet = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    done = subprocess.run([python, "-c", snippet], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.split() == "[[16 3 2] [18 9 2]]".split(), done.stdout
    where = subprocess.run([python, "-c", "import kvplan; print(kvplan.__file__)"], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=60)
    assert str(tmp_path / "env") in where.stdout, where.stdout  # kvplan from the wheel, not from this checkout
    _engines_import(python, DOCUMENTS["README.md"], tmp_path)
    for document in ("docs/sglang.md", "docs/vllm.md"):
        for line in _install_lines(document):
            _run_line(pip, line, wheel)
        _engines_import(python, DOCUMENTS[document], tmp_path)


def _engines_import(python: str, engines: tuple[str, ...], cwd: Path) -> None:
    """Each engine the document's extras install answers kvplan's own check (``missing_engine``)."""
    check = ("import sys, kvplan.transport.engines as e; from kvplan.transport.engines.registry import missing_engine; "
             "missing = [m for m in map(missing_engine, sys.argv[1:]) if m]; print(*missing, sep='\\n'); "
             "sys.exit(1 if missing else 0)")
    done = subprocess.run([python, "-c", check, *engines], capture_output=True, text=True, timeout=120,
                          env=_clean_environ(), cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
