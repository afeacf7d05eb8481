"""Plan a batch with kvplan's Planner and check it against the NumPy reference.

Run: ``python examples/plan_a_batch.py`` (on a machine without a GPU, set ``TRITON_INTERPRET=1``).
The batch is a small gpt-oss-shaped one (sliding-window state, aux rows) on a fragmented pool.
"""

import numpy as np
import torch

from kvplan.planner.device.columns import BatchColumns
from kvplan.planner.device.planner import Planner
from kvplan.planner.reference.oracle import plan_reference
from kvplan.tools.scenarios import PRESETS, build_batch

device = "cuda" if torch.cuda.is_available() else "cpu"
shape = PRESETS["gptoss-swa-p16"].scaled(layers=2)
batch = build_batch(shape, requests=4, prompt_len=[512, 300, 1024, 64], chunks=2, seed=0).to(device)

# Made once per pairing of sides: device tables, buffers per capacity bucket, CUDA graphs on a GPU.
planner = Planner(batch.src, batch.dsts, outputs=("descriptors", "runs"))

# What a scheduler holds per step: one row per transfer, destination lists as one flat array.
columns = BatchColumns.from_batch(batch)
pending = planner.plan(columns)                 # returns at once; the device may still be working
descs, offsets = pending.descriptors()          # waits for the event; raises PlanError naming a request
runs = pending.runs()                           # the compact form: runs per segment + entry tables

want, want_offsets = plan_reference(batch).descriptors()
assert np.array_equal(descs, want) and np.array_equal(offsets, want_offsets)
print(f"{len(batch.transfers)} transfers -> {len(descs):,} descriptors ({int(descs[:, 2].sum()):,} bytes), "
      f"{len(runs.runs):,} runs; equal to the reference on {device}")
