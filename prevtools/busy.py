"""Where plan() spends its time when the stream is busy: per-step wall time, 20 ms sleep queued first."""
import statistics, time
import torch
from kvplan.bench import _batch_of
from kvplan.planner import device as dv
from kvplan.planner.columns import BatchColumns
from kvplan.planner.device import Planner
batch, *_ = _batch_of("llama70b-tp8-p64", 1.0)
batch = batch.to("cuda")
cols = BatchColumns.from_batch(batch)
pl = Planner(batch.src, batch.dsts)
for _ in range(5):
    pl.plan(cols).descriptors()
cycles = int(20e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3)
key = (dv._pow2(cols.num_transfers, 8), dv._pow2(len(cols.dst_flat), 64))
for busy in (False, True):
    steps = {k: [] for k in ("next_slot", "fill", "replay", "stream", "record", "plan")}
    for i in range(20):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(cycles)
        t = [time.perf_counter()]
        slot = pl._next_slot(key); t.append(time.perf_counter())
        slot.buffers.fill(cols); t.append(time.perf_counter())
        dv._replay(slot.graph); t.append(time.perf_counter())
        s = torch.cuda.current_stream(); t.append(time.perf_counter())
        slot.event.record(s); t.append(time.perf_counter())
        slot.generation += 1
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(cycles)
        t0 = time.perf_counter(); p = pl.plan(cols); t1 = time.perf_counter()
        for k, a, b in zip(steps, t, t[1:]):
            steps[k].append((b - a) * 1e6)
        steps["plan"].append((t1 - t0) * 1e6)
        p.descriptors()
    print("busy" if busy else "idle", {k: round(statistics.median(v), 1) for k, v in steps.items()}, flush=True)
