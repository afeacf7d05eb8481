"""Packing a Python site a device call can carry: cp312 wheels unpacked, packages copied as installed here,
one ``tar.xz``. The card's Python is 3.12 with torch, triton and numpy and installs nothing from the
network (the device's KINDS.md lists what it has); :mod:`benchmarks.sglang_site` and
:mod:`benchmarks.vllm_site` say what each site holds."""

from __future__ import annotations

import glob
import importlib.metadata as metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from collections.abc import Callable

PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def download(requirements: list[str], into: str) -> None:
    """cp312 x86-64 wheels of ``requirements`` (no dependencies) into ``into``."""
    argv = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--no-deps", "--python-version",
            "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "-d", into]
    for platform in PLATFORMS:
        argv += ["--platform", platform]
    subprocess.run(argv + requirements, check=True, timeout=1800)


def unpack_wheel(wheel: str, tree: str, skip: Callable[[str], bool] = lambda name: False) -> None:
    """The wheel's files into ``tree``, but those ``skip`` names."""
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if not skip(name):
                z.extract(name, tree)


def unpack_wheels(folder: str, tree: str, skip_of: Callable[[str], Callable[[str], bool]] = lambda wheel: (
        lambda name: False)) -> None:
    """Every cp312, abi3 or pure wheel in ``folder`` into ``tree``, less the files ``skip_of(wheel)`` names."""
    for wheel in sorted(glob.glob(os.path.join(folder, "*.whl"))):
        if "cp312" in wheel or "abi3" in wheel or "py3-none" in wheel:
            unpack_wheel(wheel, tree, skip_of(os.path.basename(wheel)))


def copy_installed(import_name: str, tree: str, dists_of: dict[str, list[str]]) -> bool:
    """The package ``import_name`` installed here (source only, no compiled module) and its distributions'
    metadata into ``tree``; False where it is not installed here."""
    site = sysconfig.get_paths()["purelib"]
    for candidate in (os.path.join(site, import_name), os.path.join(site, import_name + ".py")):
        if os.path.isdir(candidate):
            shutil.copytree(candidate, os.path.join(tree, import_name), dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so"))
            break
        if os.path.isfile(candidate):
            shutil.copy2(candidate, tree)
            break
    else:
        return False
    for dist_name in dists_of.get(import_name, []):
        info = metadata.distribution(dist_name)._path  # the .dist-info folder
        shutil.copytree(info, os.path.join(tree, os.path.basename(info)), dirs_exist_ok=True)
    return True


def pack(tree: str, archive: str, missing: list[str]) -> None:
    """Everything in ``tree`` into ``archive`` (xz); says its size, and what was ``missing`` here."""
    with tarfile.open(archive, "w:xz", preset=9) as tar:
        for entry in sorted(os.listdir(tree)):
            tar.add(os.path.join(tree, entry), arcname=entry)
    size = os.path.getsize(archive) / 2**20
    print(f"{archive}: {size:.1f} MiB" + (f" (not installed here, left out: {', '.join(missing)})" if missing else ""))
