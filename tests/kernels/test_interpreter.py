"""kvplan's two adjustments to Triton's interpreter (kvplan/kernels/__init__.py): launches are
serialized, and a helper called inside a launch does not patch ``triton.language`` again. Kernels
here call helpers of their own module and of Triton's (``tl.sum`` is one, in a module that sees
``triton.language.core`` only), launch after launch; the language must be as before once they end."""

import os

import pytest
import torch
import triton
import triton.language as tl

import kvplan.kernels  # noqa: F401  (installs the adjustments)

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's adjustments")


@triton.jit
def _twice(x):
    return x + x


@triton.jit
def _sum_of_twice_kernel(src_ptr, out_ptr, N: tl.constexpr):
    values = tl.load(src_ptr + tl.arange(0, N))
    tl.store(out_ptr, tl.sum(_twice(values), axis=0))
    tl.store(out_ptr + 1, tl.sum(_twice(_twice(values)), axis=0))


def test_helpers_inside_launches_compute_and_leave_the_language_as_it_was():
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "kvplan_once", False)
    before = (tl.tensor.__add__, tl.sum, tl.core.tensor.__add__)
    for n in (4, 8, 16):
        src = torch.randint(-100, 100, (n,), dtype=torch.int64)
        out = torch.zeros(2, dtype=torch.int64)
        _sum_of_twice_kernel[(1,)](src, out, N=n)
        assert out.tolist() == [2 * int(src.sum()), 4 * int(src.sum())]
        assert (tl.tensor.__add__, tl.sum, tl.core.tensor.__add__) == before
