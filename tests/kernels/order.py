"""Run interpreted Triton programs in a shuffled order, to expose order-dependent kernels.

The interpreter runs programs one after another in pid order; a GPU does not. This patches the
interpreter's grid walk (private API of triton 3.7; see shared/notes/triton-cpu.md §10.2).
"""

from __future__ import annotations

import contextlib
import itertools
import random


@contextlib.contextmanager
def shuffled_program_order(seed: int = 0):
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx
    rng, state = random.Random(seed), {}

    def shuffled_dim(x, y, z):
        ids = list(itertools.product(range(x), range(y), range(z)))
        perm = ids[:]
        rng.shuffle(perm)
        state["map"] = dict(zip(ids, perm))
        return set_dim(x, y, z)

    def shuffled_idx(x, y, z):
        return set_idx(*state["map"][(x, y, z)])

    builder.set_grid_dim, builder.set_grid_idx = shuffled_dim, shuffled_idx
    try:
        yield
    finally:
        builder.set_grid_dim, builder.set_grid_idx = set_dim, set_idx
