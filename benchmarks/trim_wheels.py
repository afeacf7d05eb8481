"""Both engines' wheels in one device call: NIXL's and Mooncake's cp312 wheels with what kvplan never loads
taken out, so that one suite measures both engines in the same run (a call carries at most 64 MiB; the two
wheels as published weigh 58.8 + 49.7 MB).

What goes: NIXL's expert-parallel extension (``nixl_ep_*``, 91 MB unpacked) and every backend plugin but
UCX; Mooncake's store, process-group and expert-parallel extensions and its command-line programs; then,
in each wheel, the bundled shared libraries that nothing kept links (``ldd`` from every kept library).
What stays loads as published: the same files, byte for byte.

``python -m benchmarks.trim_wheels`` reads ``.whl/`` and ``.whl-mc/`` and writes ``.whl-both/`` (git-ignored),
about 28 MB with pyzmq's wheel; ``python -m benchmarks engines-two-cards`` carries it. With ``--fetch`` it
first downloads the cards' wheels into those folders (:data:`CARD_WHEELS`: the cards run CUDA 13).
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import os
import shutil
import subprocess
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The engines' cp312 wheels for the cards (CUDA 13), by engine: what ``--fetch`` downloads (pyzmq beside NIXL).
CARD_WHEELS = {"nixl": ("nixl-cu13==1.5.1", "pyzmq==27.3.0"), "mooncake": ("mooncake-transfer-engine-cuda13==0.3.14",)}

#: What kvplan never loads, per wheel (glob patterns on the paths inside it).
UNUSED = {
    "nixl": ("nixl_ep_*/*", "*/plugins/libplugin_[!U]*", "*/plugins/lib[!p]*", "*.libs/nixl/libplugin_[!U]*",
             "*.libs/nixl/lib[!p]*", "*.libs/ucx/libucx_perftest*"),
    "mooncake": ("mooncake/_ep.*", "mooncake/_store.*", "mooncake/libmooncake_pg*", "mooncake/libmooncake_ep*",
                 "mooncake/mooncake_client", "mooncake/mooncake_master", "mooncake/transfer_engine_bench"),
}


def _linked(path: str, inside: str) -> set[str]:
    """The libraries under ``inside`` that ``path`` links, as ``ldd`` resolves them."""
    out = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=60).stdout
    found = set()
    for line in out.splitlines():
        target = line.split("=>")[1].split("(")[0].strip() if "=>" in line else ""
        if target.startswith(inside):
            found.add(os.path.realpath(target))
    return found


def _files(tree: str) -> list[str]:
    """Every file under ``tree``, hidden folders included (NIXL keeps its plugins in ``.nixl_*.libs``)."""
    return sorted(os.path.join(folder, name) for folder, _, names in os.walk(tree) for name in names)


def trim(wheel: str, unused: tuple[str, ...], out_dir: str) -> str:
    """Write ``wheel`` less ``unused`` and the bundled libraries nothing kept links into ``out_dir``."""
    with tempfile.TemporaryDirectory() as tree:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tree)
        for path in _files(tree):
            if any(fnmatch.fnmatch(os.path.relpath(path, tree), p) for p in unused):
                os.remove(path)
        bundled = {os.path.realpath(p) for p in glob.glob(os.path.join(tree, "*.libs", "*")) if os.path.isfile(p)}
        kept = [p for p in _files(tree) if ".so" in os.path.basename(p) and os.path.realpath(p) not in bundled]
        needed, todo = set(), list(kept)
        while todo:
            for lib in _linked(todo.pop(), os.path.realpath(tree)):
                if lib not in needed:
                    needed.add(lib)
                    todo.append(lib)
        for lib in bundled - needed:
            os.remove(lib)
        target = os.path.join(out_dir, os.path.basename(wheel))
        with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
            for path in _files(tree):
                z.write(path, os.path.relpath(path, tree))
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trim_wheels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nixl", default=os.path.join(ROOT, ".whl"), help="folder of NIXL's and pyzmq's wheels")
    parser.add_argument("--mooncake", default=os.path.join(ROOT, ".whl-mc"), help="folder of Mooncake's wheel")
    parser.add_argument("--out", default=os.path.join(ROOT, ".whl-both"))
    parser.add_argument("--fetch", action="store_true", help="download the cards' wheels into --nixl and --mooncake first")
    args = parser.parse_args(argv)
    if args.fetch:
        from benchmarks.site_pack import download

        for engine, wanted in CARD_WHEELS.items():
            download(list(wanted), getattr(args, engine))
    os.makedirs(args.out, exist_ok=True)
    for old in glob.glob(os.path.join(args.out, "*.whl")):
        os.remove(old)
    for engine, folder in (("nixl", args.nixl), ("mooncake", args.mooncake)):
        wheels = glob.glob(os.path.join(folder, f"{engine}*.whl"))
        if len(wheels) != 1:
            parser.error(f"expected one {engine} wheel in {folder}, found {len(wheels)}")
        target = trim(wheels[0], UNUSED[engine], args.out)
        print(f"{os.path.basename(target)}: {os.path.getsize(wheels[0]) / 1e6:.1f} -> {os.path.getsize(target) / 1e6:.1f} MB")
    for pyzmq in glob.glob(os.path.join(args.nixl, "pyzmq*.whl"))[:1]:
        shutil.copy(pyzmq, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
