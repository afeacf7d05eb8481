"""How many examples a property test of the kernels draws (hypothesis' ``max_examples``).

On a CPU Triton interprets the kernels (``TRITON_INTERPRET=1``, ``make test``) and an example costs about
a hundred times what it does compiled: there such a test draws half its count (at least 10), fresh each
run (hypothesis is not derandomized here). The GPU suite (``python -m benchmarks gpu-tests``) draws the
full count with the kernels compiled.

Example::

    @settings(max_examples=examples(40), deadline=None)
"""

import os

__all__ = ["examples"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def examples(full: int) -> int:
    """``full`` where the kernels are compiled, half of it (at least 10) where they are interpreted."""
    return max(min(full, 10), full // 2) if INTERPRETED else full
