"""The SGLang-NIXL row of suite ``sglang-backends`` alone (``benchmarks.sglang_backends`` as the suite runs it),
on the card: session 44's probe of why SGLang's own NIXL backend did not end, then its row. The suite's
wheels and site installed as a suite installs them.

Answer (an H100, session 44, ``results/2026-12-05-h100-session44-sglang-backends/``): the prefill had done its
work and waited at exit on SGLang's NIXL ``transfer_worker`` threads, which are not daemon threads; with the
node leaving by ``os._exit``, SGLang's NIXL row: 64/64 in 3.98 s, ready p50 620 / p99 1,524 ms.

    python -m benchmarks.probes.sglang_nixl_once OUT
"""

import os
import subprocess
import sys

from benchmarks.__main__ import install

env = install(".whl-both", ".whl-sglang/sglang-site.tar.xz")
env.update(MOONCAKE_PROTOCOL="tcp", SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND="python")
subprocess.run([sys.executable, "-m", "benchmarks.sglang_backends", "--device", "cuda", "--layers", "32", "--heads",
                "8", "--head-dim", "128", "--waves", "4", "--runs", "sglang-nixl", "--deadline-s", "60", "--json",
                os.path.join(sys.argv[1], "sglang-nixl.json")], env=env, timeout=200, check=False)
