"""Where the host time of ``kvplan.plan`` goes: cProfile over repeated calls of one scenario.

Run on a GPU:  ``TRITON_INTERPRET=0 PYTHONPATH=. python -m benchmarks.probes.profile_plan [scenario]``

Answer (the eager planner before graph replay, results/archive/): the batch layout took ~40% of the host time, the list job and packing ~25%, the hand-off (event, error check, descriptor copy) ~15%; graph replay and the device layout kernel since took those steps off the host.
"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from kvplan.tools.bench import scenario_batch
from kvplan.planner.device.planner import Planner


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "llama70b-tp8-p64"
    graph = "--graph" in sys.argv
    batch = scenario_batch(name)[0].to("cuda")
    planner = Planner(batch.src, batch.dsts, graphs=graph)
    run = lambda: planner.plan(batch).descriptors()  # noqa: E731
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(50):
        run()
    profile.disable()
    stats = pstats.Stats(profile).strip_dirs()
    print(f"== {name}: 50 plans to host descriptors ({'graph replay' if graph else 'eager'}), by total time")
    stats.sort_stats("tottime").print_stats(25)
    print(f"== {name}: by cumulative time")
    stats.sort_stats("cumtime").print_stats(30)
    device_time(planner, batch, name)


def device_time(planner: Planner, batch, name: str, calls: int = 20) -> None:
    """Kernel and copy time on the GPU per call, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            planner.plan(batch).descriptors()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total_us = sum(e.self_device_time_total for e in events) / calls
    print(f"== {name}: device time per call {total_us:.1f} us (kernels and copies, from torch.profiler)")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
        print(f"   {e.self_device_time_total / calls:9.1f} us  {e.count // calls:3d}x  {e.key[:90]}")


if __name__ == "__main__":
    main()
