"""Every kernel compiles to a Hopper cubin (sm_90) on this CPU machine.

Runs in its own process with TRITON_INTERPRET=0 (``make test`` does this); the interpreter and the
compiler cannot share a process.
"""

import os

import pytest

pytestmark = pytest.mark.compile_check


def _specs():
    from kvplan.kernels import (batch_layout, checksum, copy, elements, expand, index_lists, run_table, slot_check,
                                summary, translate)

    for module in (batch_layout, elements, run_table, summary, expand, index_lists, slot_check, copy, checksum,
                   translate):
        for kernel, signature, constexprs in module.COMPILE_SPECS:
            yield pytest.param(kernel, signature, constexprs,
                               id=f"{module.__name__.rsplit('.', 1)[-1]}.{kernel.fn.__name__}-{constexprs}")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs TRITON_INTERPRET=0")
@pytest.mark.parametrize("kernel, signature, constexprs", list(_specs()))
def test_kernel_compiles_for_sm90(kernel, signature, constexprs):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"], "no cubin was produced"
