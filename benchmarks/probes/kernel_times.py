"""Where a plan's device time goes: each kernel and copy of one plan, per output form, from torch.profiler.

For each scenario and output form (compact runs, Nx3 descriptors, counts only) it prints every device
activity of an eager plan read by the host in that form (name, calls per plan, us per plan), then the
same for graph replay, with the replay's device span (``kvplan.tools.bench.device_span_ms``, median of 50).

Run on a GPU:  ``TRITON_INTERPRET=0 PYTHONPATH=. python -m benchmarks.probes.kernel_times [scenario ...]``

Answer (one H200, session 16, results/archive/): a graph-replayed plan's device span is 32-65 us; no kernel dominates (layout, elements, checks, summary, compaction and the output kernel each take 3-11 us for `p64`), and the copies in and out cost as much as a kernel.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch

from kvplan.planner.device.columns import BatchColumns
from kvplan.planner.device.planner import Planner
from kvplan.tools.bench import device_span_ms, scenario_batch

# output form: (the planner's outputs, how the host reads them)
FORMS = {"runs": (("runs",), lambda p: p.runs()), "descriptors": (("descriptors",), lambda p: p.descriptors()),
         "counts": ((), lambda p: p.check())}


def _activities(planner: Planner, cols: BatchColumns, calls: int, read) -> dict[str, list[float]]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            read(planner.plan(cols))
        torch.cuda.synchronize()
    out: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            out[event.name[:60]].append(event.device_time)
    return out


def main() -> None:
    names = [a for a in sys.argv[1:] if not a.startswith("-")] or ["llama70b-tp8-p64", "qwen3next-mamba-p64"]
    print(torch.cuda.get_device_name(), flush=True)
    for name in names:
        batch = scenario_batch(name)[0].to("cuda")
        cols = BatchColumns.from_batch(batch)
        for form, (outputs, read) in FORMS.items():
            eager = Planner(batch.src, batch.dsts, graphs=False, outputs=outputs)
            for _ in range(3):
                read(eager.plan(cols))
            calls = 20
            acts = _activities(eager, cols, calls, read)
            total = sum(sum(v) for v in acts.values()) / calls
            print(f"== {name} / {form}: eager, device activities per plan (sum {total:.1f} us)")
            for act, times in sorted(acts.items(), key=lambda kv: -sum(kv[1])):
                print(f"   {sum(times) / calls:8.1f} us  x{len(times) / calls:4.1f}  {act}")
            graph = Planner(batch.src, batch.dsts, graphs=True, outputs=outputs)
            for _ in range(3):
                read(graph.plan(cols))
            gacts = _activities(graph, cols, calls, read)
            gtotal = sum(sum(v) for v in gacts.values()) / calls
            print(f"   graph replay: device span {device_span_ms(graph, cols, 50) * 1e3:.1f} us (events, host work hidden), activities "
                  f"{gtotal:.1f} us in {sum(len(v) for v in gacts.values()) / calls:.0f} per plan", flush=True)
            for act, times in sorted(gacts.items(), key=lambda kv: -sum(kv[1])):
                print(f"   {sum(times) / calls:8.1f} us  x{len(times) / calls:4.1f}  {act}")


if __name__ == "__main__":
    main()
