"""Where ``Planner.plan``'s host time goes, step by step, per scenario (issue 10's host-CPU target).

Thread time (``time.thread_time``) of each host step of a graph-replayed ``plan``, medians of 200 calls on
an idle GPU: the columns into the pinned input (``fill``), the slot's turn (``slot``), the graph's replay
(``replay``), the event (``record``), and the whole ``plan``.

Run on a GPU:  ``TRITON_INTERPRET=0 PYTHONPATH=. python -m benchmarks.plan_host_steps [scenario ...]``
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from kvplan.planner.device import buffers as dv
from kvplan.planner.device.columns import BatchColumns
from kvplan.planner.device.planner import Planner
from kvplan.tools.bench import SCENARIOS, scenario_batch


def _median_us(step, runs: int = 200) -> float:
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.thread_time()
        step()
        times.append(time.thread_time() - t0)
    return round(statistics.median(times) * 1e6, 1)


def main() -> None:
    names = sys.argv[1:] or list(SCENARIOS)
    out = {"card": torch.cuda.get_device_name()}
    for name in names:
        batch = scenario_batch(name)[0].to("cuda")
        cols = BatchColumns.from_batch(batch)
        planner = Planner(batch.src, batch.dsts, outputs=("descriptors",))
        for _ in range(4):
            planner.plan(cols).descriptors()
        key = (dv.pow2(cols.num_transfers, 8), dv.pow2(len(cols.dst_flat), 64))
        slot = planner._rings[key][0]
        stream = torch.cuda.current_stream()
        row = {
            "fill": _median_us(lambda: slot.buffers.fill(cols)),
            "slot": _median_us(lambda: planner._next_slot(key)),
            "replay": _median_us(lambda: dv.replay(slot.graph)),
            "record": _median_us(lambda: slot.event.record(stream)),
            "plan": _median_us(lambda: planner.plan(cols)),
        }
        out[name] = row
        print(name, row, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
