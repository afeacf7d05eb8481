"""An engine's own environment for ``make test``: kvplan's wheel resolved beside the engine, then installed.

A user installs kvplan into the engine's environment, so each supported engine gets one here:

1. a fresh virtual environment and the whole resolution of kvplan's wheel beside the engine's pinned
   release (``uv pip compile``, seconds; a conflict stops the build with uv's words). pip's own resolver
   in a fresh environment resolved the same, but downloaded every wheel of it to read its metadata (4.4 GB
   a resolution from this machine's index, 150 s of CPU for the two: a fifth of ``make test``'s), and
   step 4 has pip's resolver check kvplan's requirements against the result anyway;
2. the part of that resolution the integration tests need, at the versions it chose (a constraints file
   of every resolved pin): the engine's torch and triton, numpy, and the modules the engine's transfer
   code imports. The engine's GPU kernels (flash attention, DeepGEMM, CUTLASS, ...) are not installed:
   nothing on a CPU box calls them. uv installs them: the two environments hold 5 GB each, which pip
   unpacked in minutes on two cores;
3. the engine itself without its dependencies, and the transfer engines (NIXL, Mooncake);
4. kvplan's wheel, installed by pip's resolver (never ``--no-deps``) against what steps 2 and 3 installed.

Usage (the Makefile's ``setup-sglang`` and ``setup-vllm``)::

    python tests/engine_env.py sglang .venv-sglang dist/kvplan-0.1.0-py3-none-any.whl
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import venv
from dataclasses import dataclass
from pathlib import Path

# what every engine's environment gets beside kvplan's own dependencies
TRANSFER_ENGINES = ("nixl-cu12==1.5.1", "mooncake-transfer-engine-non-cuda==0.3.13.post1")
INSTALL = ("install", "-q", "--no-compile", "--disable-pip-version-check")


@dataclass(frozen=True)
class Engine:
    """An engine release and what of its resolution the integration tests import."""

    requirement: str            # the engine, pinned: what a user's environment holds
    imports: tuple[str, ...]    # the distributions its transfer and scheduler modules import
    extras: str = "test"        # kvplan's extras the tests need


# What SGLang 0.5.23's disaggregation, scheduler and manager modules import (tests/sglang_real.py
# stands in for its multimodal torchvision import and its forward-pass kernels).
SGLANG = Engine("sglang==0.5.23", (
    "orjson", "zstandard", "psutil", "pybase64", "requests", "pillow", "starlette", "msgspec", "pydantic",
    "tqdm", "ipython", "aiohttp", "transformers", "dill", "apache-tvm-ffi", "sentencepiece",
    "compressed-tensors", "gguf", "prometheus-client", "openai", "partial-json-parser", "einops",
))

# What vLLM 0.33.0's KV-connector modules, its scheduler and its own connector tests import.
VLLM = Engine("vllm==0.33.0", (
    "openai", "oss-harmony", "cbor2", "cachetools", "cloudpickle", "uvloop", "xgrammar", "fastapi",
    "llguidance", "pydantic", "msgspec", "transformers", "aiohttp", "psutil", "pybase64", "orjson",
    "requests", "pillow", "tqdm", "prometheus-client", "einops", "sentencepiece", "regex", "blake3",
    "pyyaml", "tokenizers", "huggingface-hub", "safetensors", "protobuf", "py-cpuinfo", "setproctitle",
    "partial-json-parser", "mistral-common", "compressed-tensors", "gguf", "tiktoken", "lark", "numba",
    "diskcache", "watchfiles", "python-json-logger", "opentelemetry-api", "ijson", "anthropic",
    "model-hosting-container-standards", "depyf", "fastsafetensors", "outlines-core", "lm-format-enforcer",
))

ENGINES = {"sglang": SGLANG, "vllm": VLLM}


def _run(args: list[str], what: str) -> None:
    started = time.monotonic()
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-40:])
        raise SystemExit(f"engine_env: {what} failed (exit {done.returncode}):\n{tail}")
    print(f"engine_env: {what} ({time.monotonic() - started:.0f} s)", flush=True)


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def resolved_pins(report: dict) -> dict[str, str]:
    """``{distribution: version}`` of every package pip's ``--report`` would install."""
    return {_canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}


def exact_pins(requirements: list[str]) -> dict[str, str]:
    """``{name: version}`` of the ``==`` pins among a distribution's requirements (``Requires-Dist``), those
    of its extras left out: what an engine pins its torch and triton to."""
    pins = {}
    for requirement in requirements:
        found = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;,]+)", requirement)
        if found and "extra ==" not in requirement:
            pins[found.group(1).lower()] = found.group(2)
    return pins


def compiled_pins(text: str) -> dict[str, str]:
    """``{distribution: version}`` of ``uv pip compile``'s output (``name==version`` lines)."""
    pins = {}
    for line in text.splitlines():
        found = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", line.strip())
        if found:
            pins[_canonical(found.group(1))] = found.group(2)
    return pins


def build(name: str, env_dir: Path, wheel: Path) -> None:
    engine = ENGINES[name]
    if env_dir.exists():
        shutil.rmtree(env_dir)
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = str(env_dir / "bin" / "python")
    uv = [shutil.which("uv") or str(Path(sys.executable).parent / "uv"), "pip"]
    kvplan = f"{wheel.resolve()}[{engine.extras}]"
    # 1. the whole resolution: kvplan's wheel beside the engine's release
    wanted_in = env_dir / "resolve.in"
    wanted_in.write_text(f"kvplan[{engine.extras}] @ {wheel.resolve().as_uri()}\n{engine.requirement}\n")
    resolved = env_dir / "resolved.txt"
    _run(uv + ["compile", "-q", "--python", python, str(wanted_in), "-o", str(resolved)],
         f"kvplan's wheel resolved beside {engine.requirement}")
    pins = compiled_pins(resolved.read_text())
    pins.pop("kvplan", None)
    constraints = env_dir / "resolved-constraints.txt"
    constraints.write_text("".join(f"{dist}=={version}\n" for dist, version in sorted(pins.items())))
    print(f"engine_env: {engine.requirement} resolves with torch {pins.get('torch')}, triton {pins.get('triton')}, "
          f"numpy {pins.get('numpy')}", flush=True)
    # 2. what the tests need of that resolution, at its versions
    wanted = ["torch", "triton", "numpy", *(_canonical(d) for d in engine.imports if _canonical(d) in pins)]
    _run(uv + ["install", "-q", "--python", python, "-c", str(constraints), *(f"{d}=={pins[d]}" for d in wanted)],
         f"the resolved torch {pins['torch']}, triton {pins['triton']} and {len(wanted) - 2} more")
    # 3. the engine's own code (not its GPU kernels), and the transfer engines
    _run(uv + ["install", "-q", "--python", python, "--no-deps", engine.requirement, *TRANSFER_ENGINES],
         f"{engine.requirement} and the transfer engines, without their dependencies")
    # 4. kvplan, through pip's resolver, against what is installed
    _run([python, "-m", "pip", *INSTALL, "-c", str(constraints), kvplan], "kvplan's wheel through pip's resolver")


def main(argv: list[str]) -> None:
    if len(argv) != 3 or argv[0] not in ENGINES:
        raise SystemExit(f"usage: python tests/engine_env.py {{{','.join(ENGINES)}}} ENV_DIR WHEEL")
    build(argv[0], Path(argv[1]), Path(argv[2]))


if __name__ == "__main__":
    main(sys.argv[1:])
