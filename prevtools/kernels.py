import sys, torch
from kvplan.bench import SCENARIOS
from kvplan.planner.device import Planner
from kvplan.scenarios import PRESETS, build_batch
from benchmarks.profile_plan import device_time
for name in sys.argv[1:]:
    requests, prompt_len = SCENARIOS[name]
    batch = build_batch(PRESETS[name], requests, prompt_len).to("cuda")
    planner = Planner(batch.src, batch.dsts, graphs=False)
    for _ in range(3):
        planner.plan(batch).descriptors()
    torch.cuda.synchronize()
    device_time(planner, batch, name)
    print("T", len(batch.transfers), "K", planner.static.K, flush=True)
