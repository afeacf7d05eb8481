"""vLLM 0.33.0's Python and what its connector's import chain needs, as one archive a device call can carry.

vLLM's wheel installs 824 MB, nearly all of it compiled extensions built for torch 2.14 (the cards have
2.11): none of them is carried. ``benchmarks/vllm_backends.py --device cuda`` drives both connectors
without a model, so no vLLM kernel runs; the CUDA platform's import of ``vllm._C_stable_libtorch`` (92 MB,
built for 2.14) meets a stand-in module there (``tests/integrations/vllm_node.py``). This writes
``.whl-vllm/vllm-site.tar.xz`` (git-ignored), to unpack on the card and put on ``PYTHONPATH``:

* vLLM's Python from vLLM's environment (``make setup-vllm``'s ``.venv-vllm``, whose Python runs this), less
  every compiled extension, its Rust
  front end and its vendored kernels' C++ and CUDA sources (:data:`NOT_LOADED`);
* the pure-Python packages of that folder the card lacks (cachetools, fastapi, openai), with metadata;
* the packages with compiled code in the chain that the card lacks, from their cp312 wheels at the
  versions installed in that environment;
* the pure-Python packages of this environment that the chain imports and the card lacks (pydantic and
  what it imports, starlette, ...); nothing the card has (transformers 5.17, tokenizers, huggingface-hub,
  cloudpickle, uvloop, regex, msgpack: the device's KINDS.md), and no engine (``.whl-both`` carries NIXL
  and pyzmq: ``python -m benchmarks.trim_wheels``). Both together stay under a call's 64 MiB.

Which packages: those a ``--connector nixl`` side imports from outside the standard library here
(session 44), less the card's.

Example::

    .venv-vllm/bin/python -m benchmarks.vllm_site          # then carry .whl-vllm and .whl-both
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata as metadata
import os
import shutil
import sysconfig
import tempfile

from benchmarks.site_pack import copy_installed, download, pack, unpack_wheels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_SITE = sysconfig.get_paths()["purelib"]  # vLLM's environment's site-packages (run with its Python)

#: Folders of vLLM's environment carried as they are (pure Python, each with its ``.dist-info``).
FROM_VLLM_SITE = ("vllm", "cachetools", "fastapi", "openai")

#: Distributions with compiled code in the chain that the card lacks: cp312 wheels at the version installed
#: in vLLM's environment (``oss-harmony`` provides ``openai_harmony``, as vLLM's resolution has it).
COMPILED = ("cbor2", "llguidance", "oss-harmony", "xgrammar", "msgspec", "orjson", "pybase64", "pydantic-core",
            "apache-tvm-ffi")

#: Pure-Python packages of this environment that the chain imports and the card lacks (import names).
PURE = ("pydantic", "annotated_types", "annotated_doc", "typing_inspection", "starlette", "httpx2", "httpcore2",
        "dill", "partial_json_parser", "truststore", "sniffio", "typing_extensions")


def installed_version(dist: str) -> str:
    """The version of ``dist`` in vLLM's environment."""
    found = [d.version for d in metadata.distributions(path=[VLLM_SITE]) if d.metadata["Name"].lower() == dist]
    return found[0] if found else metadata.version(dist)


#: What no connector process loads: compiled modules, the Rust front end's binary (61 MB), the C++ and CUDA
#: sources and headers of vendored kernels, the API server's web assets.
NOT_LOADED = ("__pycache__", "*.so", "vllm-rs", "*.h", "*.hpp", "*.cuh", "*.cu", "*.cpp", "*.cc", "*.js", "*.css")


def copy_vllm_site(name: str, tree: str) -> None:
    """Package ``name`` of vLLM's environment and its ``.dist-info``, less what no connector process loads."""
    shutil.copytree(os.path.join(VLLM_SITE, name), os.path.join(tree, name), ignore=shutil.ignore_patterns(*NOT_LOADED))
    for info in glob.glob(os.path.join(VLLM_SITE, f"{name}-*.dist-info")):
        shutil.copytree(info, os.path.join(tree, os.path.basename(info)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_site", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, ".whl-vllm"))
    args = parser.parse_args(argv)
    if not os.path.isdir(os.path.join(VLLM_SITE, "vllm")):
        raise SystemExit(f"{VLLM_SITE} has no vLLM: run make setup-vllm, then this with .venv-vllm/bin/python")
    wheels = os.path.join(args.out, "wheels")
    os.makedirs(wheels, exist_ok=True)
    download([f"{name}=={installed_version(name)}" for name in COMPILED], wheels)
    dists_of = metadata.packages_distributions()
    with tempfile.TemporaryDirectory() as tree:
        for name in FROM_VLLM_SITE:
            copy_vllm_site(name, tree)
        unpack_wheels(wheels, tree)
        missing = [name for name in PURE if not copy_installed(name, tree, dists_of)]
        pack(tree, os.path.join(args.out, "vllm-site.tar.xz"), missing)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
