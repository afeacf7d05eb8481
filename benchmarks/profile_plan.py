"""Where the host time of ``gpu.plan`` goes: cProfile over repeated calls of one scenario.

Run on a GPU:  ``TRITON_INTERPRET=0 PYTHONPATH=. python -m benchmarks.profile_plan [scenario]``
"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from kvplan.bench import SCENARIOS, _device_batch
from kvplan.planner import gpu
from kvplan.scenarios import PRESETS, build_batch


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "llama70b-tp8-p64"
    requests, prompt_len = SCENARIOS[name]
    batch = _device_batch(build_batch(PRESETS[name], requests, prompt_len), torch.device("cuda"))
    for _ in range(5):
        gpu.plan(batch).descriptors()
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(50):
        gpu.plan(batch)
        torch.cuda.synchronize()
    profile.disable()
    stats = pstats.Stats(profile).strip_dirs()
    print(f"== {name}: 50 calls of gpu.plan, by total time")
    stats.sort_stats("tottime").print_stats(25)
    print(f"== {name}: by cumulative time")
    stats.sort_stats("cumtime").print_stats(30)


if __name__ == "__main__":
    main()
