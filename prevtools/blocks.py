import sys, torch
from kvplan.bench import _batch_of, _kernel_ms, median_ms
from kvplan.planner.columns import BatchColumns
from kvplan.planner.device import Planner
for name in sys.argv[1:]:
    batch, *_ = _batch_of(name, 1.0)
    batch = batch.to("cuda")
    cols = BatchColumns.from_batch(batch)
    for block in (256, 512, 1024):
        counts = Planner(batch.src, batch.dsts, outputs=(), block=block)
        full = Planner(batch.src, batch.dsts, block=block)
        k = _kernel_ms(counts, cols, 30)
        g = median_ms(lambda: full.plan(cols).descriptors(), 30, warmup=5)
        print(f"{name} block {block}: kernels {k*1e3:.1f} us, plan->descriptors {g*1e3:.1f} us", flush=True)
