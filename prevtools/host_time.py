"""Host CPU time of Planner.plan (graph replay) per scenario: median and p90 of 200 calls, GPU idle."""
import json, statistics, sys, time
import numpy as np, torch
from kvplan.bench import SCENARIOS, _batch_of
from kvplan.planner.columns import BatchColumns
from kvplan.planner.device import Planner
out = {}
for name in SCENARIOS:
    batch, *_ = _batch_of(name, 1.0)
    batch = batch.to("cuda")
    cols = BatchColumns.from_batch(batch)
    planner = Planner(batch.src, batch.dsts)
    for _ in range(5):
        planner.plan(cols).descriptors()
    cpu, wall = [], []
    for _ in range(200):
        torch.cuda.synchronize()
        t0, w0 = time.thread_time(), time.perf_counter()
        p = planner.plan(cols)
        cpu.append(time.thread_time() - t0); wall.append(time.perf_counter() - w0)
        p.descriptors()
    out[name] = {"cpu_us_p50": statistics.median(cpu) * 1e6, "cpu_us_p90": float(np.percentile(cpu, 90)) * 1e6,
                 "wall_us_p50": statistics.median(wall) * 1e6}
    print(name, {k: round(v, 1) for k, v in out[name].items()}, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
