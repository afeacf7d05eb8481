"""SGLang's own code (0.5.23), imported for the differential tests, or a skip where it is absent.

``make setup-sglang`` builds SGLang's environment (``.venv-sglang``, ``tests/engine_env.py``): the resolution
of kvplan's wheel beside ``sglang==0.5.23``, of which SGLang's torch, triton and the packages its import chain
asks for are installed, and SGLang itself without its GPU kernels.
SGLang's configs import ``torchvision.transforms`` for multimodal preprocessing, which nothing in
its disaggregation code calls; the torchvision wheels on PyPI need CUDA libraries and the CPU ones
are not reachable here, so where ``import torchvision`` fails a stand-in module answers that import
with inert objects. On a GPU (``benchmarks.sglang_backends --device cuda``) SGLang imports its
forward-pass kernels (``sgl_kernel``) at module level; where no build of them is installed a stand-in
answers that import too. Everything the tests call is SGLang's real code.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import pytest

SGLANG_VERSION = "0.5.23"


class _Inert:
    """Any attribute, any call, any base class: what SGLang's multimodal imports touch at import."""

    def __getattr__(self, name: str) -> "_Inert":
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()

    def __call__(self, *args, **kwargs) -> "_Inert":
        return _Inert()

    def __mro_entries__(self, bases):
        return (object,)


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"  # transformers reads it; 0.0.0 keeps its torchvision paths off

        def attr(name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Inert()

        module.__getattr__ = attr
        return module

    def exec_module(self, module) -> None:
        pass


class _StandInFinder(importlib.abc.MetaPathFinder):
    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(self, name, path, target=None):
        if name == self.package or name.startswith(self.package + "."):
            return importlib.machinery.ModuleSpec(name, _StandInLoader(), is_package=True)
        return None


def _stand_ins() -> None:
    """Stand-ins for the packages SGLang imports but its transfer path never calls, where they do not load:
    torchvision (multimodal preprocessing) and, on a GPU, ``sgl_kernel`` (forward-pass kernels: SGLang
    imports them at module level when CUDA is present; the card has no build of them, and the harness
    stands in for the forward pass)."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # absent, or a CUDA build that cannot load its ops here
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        sys.meta_path.insert(0, _StandInFinder("torchvision"))
    import torch

    if torch.cuda.is_available() and importlib.util.find_spec("sgl_kernel") is None:
        sys.meta_path.insert(0, _StandInFinder("sgl_kernel"))


def sglang_module(name: str):
    """Import ``sglang.<name>`` from the installed SGLang, or skip the test where it is not installed."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip(f"sglang {SGLANG_VERSION} is not installed (make setup-sglang)")
    _stand_ins()
    import sglang

    if sglang.__version__ != SGLANG_VERSION:
        pytest.skip(f"these tests pin sglang {SGLANG_VERSION}, found {sglang.__version__}")
    return importlib.import_module(f"sglang.{name}")


if __name__ == "__main__":
    # ``python -m tests.sglang_real SCRIPT [ARGS]``: run SCRIPT as ``__main__`` where SGLang is installed
    # as ``make setup-sglang`` installs it (no torchvision: the stand-in answers its import)
    import runpy

    if len(sys.argv) < 2:
        sys.exit("usage: python -m tests.sglang_real SCRIPT [ARGS...]")
    _stand_ins()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
