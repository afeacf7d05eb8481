"""SGLang 0.5.23 and what its scheduler-side import chain needs, as one archive a device call can carry.

The card's Python is 3.12 with torch, triton and numpy and installs nothing from the network; SGLang's
cp312 wheel alone weighs 39 MB and its import chain (``disaggregation/prefill.py``, ``decode.py``,
``managers/``, ``mem_cache/``) pulls in transformers, pydantic, openai and about forty more packages.
This writes ``.whl-sglang/sglang-site.tar.xz`` (git-ignored), to unpack on the card and put on
``PYTHONPATH``:

* SGLang from its cp312 wheel less what no scheduler loads: ``multimodal_gen/`` (diffusion serving),
  ``test/``, and the Rust extensions but the radix tree's core (``srt/mem_cache/rust_tree_core``);
* the packages with compiled code that the card lacks (or has older than transformers asks for) from
  their cp312 wheels, each at the version ``make setup-sglang`` installs in SGLang's environment (run this
  with its Python);
* the pure-Python packages it lacks as installed here (source runs the same on 3.12), with their
  metadata (transformers checks its dependencies' versions when imported);
* nothing the card already has (torch, numpy, pytest, pillow, aiohttp and the rest: the device's
  KINDS.md lists them), and no engine: the engines' wheels travel in ``.whl-both/``
  (``python -m benchmarks.trim_wheels``). Both together stay under a call's 64 MiB;
* kvplan's metadata (not its code, which is the working tree): SGLang finds plugins by their entry
  points, so ``load_plugins()`` finds kvplan's only where a distribution declares it.

Example::

    .venv-sglang/bin/python -m benchmarks.sglang_site          # then carry .whl-sglang and .whl-both
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import tempfile

from benchmarks.site_pack import copy_installed, download, pack, unpack_wheels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SGLANG = "sglang==0.5.23"

#: Distributions with compiled code in SGLang's import chain that the card lacks, or has at a version older
#: than transformers 5.24 checks for when imported: taken as cp312 wheels.
COMPILED = ("orjson", "pybase64", "pydantic-core", "tokenizers", "apache-tvm-ffi", "zstandard", "msgspec", "regex",
            "safetensors")

#: Pure-Python packages of the chain that the card lacks or has at another version (import names), copied as
#: installed here with their metadata. What the card has (device KINDS.md: aiohttp, pillow, psutil, pyyaml,
#: requests, rich, tqdm and the rest of the chain) is not carried.
PURE = ("IPython", "traitlets", "annotated_types", "compressed_tensors", "dill", "distro", "gguf", "httpcore2",
        "httpx2", "huggingface_hub", "loguru", "openai", "partial_json_parser", "pydantic", "sniffio", "starlette",
        "transformers", "truststore", "typing_inspection", "typing_extensions")

#: What SGLang's wheel carries that no scheduler process loads (folders, and the Rust extensions' libraries).
SGLANG_UNUSED = ("sglang/multimodal_gen/", "sglang/test/")
RUST_EXTENSIONS = "sglang/srt/rust_extensions/"

def sglang_unused(name: str) -> bool:
    """A file of SGLang's wheel that no scheduler process loads."""
    return name.startswith(SGLANG_UNUSED) or (name.startswith(RUST_EXTENSIONS) and ".so" in name)


def kvplan_metadata(tree: str) -> None:
    """A ``kvplan`` distribution's metadata in ``tree``: its name, version and SGLang plugin entry point."""
    info = os.path.join(tree, f"kvplan-{metadata.version('kvplan')}.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as handle:
        handle.write(f"Metadata-Version: 2.1\nName: kvplan\nVersion: {metadata.version('kvplan')}\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as handle:
        handle.write(metadata.distribution("kvplan").read_text("entry_points.txt"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sglang_site", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, ".whl-sglang"))
    args = parser.parse_args(argv)
    wheels = os.path.join(args.out, "wheels")
    os.makedirs(wheels, exist_ok=True)
    wanted = [SGLANG] + [f"{name}=={metadata.version(name)}" for name in COMPILED]
    download(wanted, wheels)
    dists_of = metadata.packages_distributions()
    with tempfile.TemporaryDirectory() as tree:
        unpack_wheels(wheels, tree, lambda wheel: sglang_unused if wheel.startswith("sglang-") else lambda name: False)
        missing = [name for name in PURE if not copy_installed(name, tree, dists_of)]
        kvplan_metadata(tree)
        pack(tree, os.path.join(args.out, "sglang-site.tar.xz"), missing)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
