"""Plan latency of kvplan's GPU planner against the SGLang-style baseline, side by side.

Run on a GPU:  ``TRITON_INTERPRET=0 PYTHONPATH=. python -m benchmarks.plan_latency``
It prints a Markdown table and writes JSON next to it with ``--json PATH``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from kvplan.baseline import sglang_style_descs
from kvplan.planner import gpu
from kvplan.planner.model import Batch, SideMemory
from kvplan.scenarios import PRESETS, build_batch

SCENARIOS = {  # name -> (requests, prompt_len), benchmarks.md
    "llama70b-tp8-p64": (32, 8192),
    "llama70b-tp8-p1": (8, 8192),
}


def device_batch(batch: Batch, device: torch.device) -> Batch:
    src = batch.src
    table = torch.as_tensor(src.req_to_token).to(device)
    return Batch(SideMemory(src.kv, src.state, src.aux, table), batch.dsts, batch.transfers, batch.policy,
                 batch.validate)


def kvplan_descs(batch: Batch) -> np.ndarray:
    return gpu.plan(batch).descriptors()[0]


def baseline_descs(batch: Batch) -> np.ndarray:
    return sglang_style_descs(batch)


def measure(fn, batch: Batch, runs: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn(batch)
    times = []
    for _ in range(runs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(batch)
        times.append(time.perf_counter() - t0)
    return times


def plan_call_ms(batch: Batch, runs: int) -> float:
    """Median host time of the ``gpu.plan`` call alone: bookkeeping and kernel launches."""
    out = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gpu.plan(batch)
        out.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(out) * 1e3


def gpu_time_ms(batch: Batch, runs: int) -> float:
    """Median device time from the first launch to the plan's event, by CUDA events."""
    out = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        gpu.plan(batch)
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return statistics.median(out)


def run(names: list[str], runs: int, scale: float) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for name in names:
        requests, prompt_len = SCENARIOS[name]
        requests = max(1, int(requests * scale))
        prompt_len = max(64, int(prompt_len * scale))
        shape = PRESETS[name] if scale == 1 else PRESETS[name].scaled(layers=max(1, int(PRESETS[name].layers * scale)))
        batch = device_batch(build_batch(shape, requests, prompt_len, seed=0), device)
        ours, theirs = kvplan_descs(batch), baseline_descs(batch)
        assert np.array_equal(ours, theirs), f"{name}: kvplan and the baseline disagree"
        t_ours, t_base = measure(kvplan_descs, batch, runs), measure(baseline_descs, batch, runs)
        row = {
            "scenario": name, "requests": requests, "prompt_len": prompt_len, "descriptors": int(len(ours)),
            "baseline_ms": statistics.median(t_base) * 1e3, "kvplan_ms": statistics.median(t_ours) * 1e3,
            "kvplan_gpu_ms": gpu_time_ms(batch, runs) if device.type == "cuda" else None,
            "kvplan_call_ms": plan_call_ms(batch, runs) if device.type == "cuda" else None,
        }
        row["ratio"] = row["baseline_ms"] / row["kvplan_ms"]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--scale", type=float, default=1.0, help="shrink requests, tokens and layers (CI: 0.05)")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = run(args.scenario or sorted(SCENARIOS), args.runs, args.scale)
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter)"
    print(f"card: {card}; torch {torch.__version__}")
    print("| scenario | descriptors | baseline ms | kvplan ms | kvplan GPU ms | plan() call ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        gpu_ms = f"{r['kvplan_gpu_ms']:.3f}" if r["kvplan_gpu_ms"] is not None else "-"
        call_ms = f"{r['kvplan_call_ms']:.3f}" if r["kvplan_call_ms"] is not None else "-"
        print(f"| {r['scenario']} | {r['descriptors']:,} | {r['baseline_ms']:.2f} | {r['kvplan_ms']:.3f} | {gpu_ms} | {call_ms} | "
              f"{r['ratio']:.1f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"card": card, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
