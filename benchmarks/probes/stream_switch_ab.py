"""Plan-to-descriptors latency with torch's stream wrappers (old) against kvplan's stream fast path (new),
alternating on one machine: ``OnStream`` (read by ``kvplan.planner.device.pending``) and ``current_stream`` (by ``kvplan.planner.device.planner``).

Run on a GPU:  ``TRITON_INTERPRET=0 PYTHONPATH=. python -m benchmarks.probes.stream_switch_ab``

Answer (one H200, session 16, results/archive/): `with torch.cuda.stream(...)` costs 9.5-16 us on that host; the planner's switch through torch's own bindings saves that on every plan and every read of descriptors.
"""

import statistics
import time

import torch

import kvplan.planner.device.pending as pending_module
import kvplan.planner.device.planner as planner_module
from kvplan.planner.device.columns import BatchColumns
from kvplan.planner.device.planner import Planner
from kvplan.tools.bench import scenario_batch

FAST = (pending_module.OnStream, planner_module.current_stream)
SLOW = (lambda s: torch.cuda.stream(s), lambda d: torch.cuda.current_stream(d))

def timed_us(fn, n: int) -> tuple[float, float]:
    """Median and p99 of ``n`` calls of ``fn`` after 30 to warm up, in us."""
    for _ in range(30):
        fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6, sorted(times)[int(0.99 * n)] * 1e6


def main() -> None:
    print(torch.cuda.get_device_name())
    for name in ("llama70b-tp8-p64", "qwen3next-mamba-p64"):
        batch = scenario_batch(name)[0].to("cuda")
        cols = BatchColumns.from_batch(batch)
        planner = Planner(batch.src, batch.dsts, graphs=True)
        for _ in range(5):
            planner.plan(cols).descriptors()
        found: dict[str, list] = {"old": [], "new": []}
        for round_ in range(4):
            order = (("old", SLOW), ("new", FAST)) if round_ % 2 == 0 else (("new", FAST), ("old", SLOW))
            for label, (on, current) in order:
                pending_module.OnStream, planner_module.current_stream = on, current
                found[label].append(timed_us(lambda: planner.plan(cols).descriptors(), 300))
        pending_module.OnStream, planner_module.current_stream = FAST
        for label, values in found.items():
            print(name, label, "plan+descriptors median/p99 us:", [f"{m:.1f}/{p:.1f}" for m, p in values])


if __name__ == "__main__":
    main()
