"""``kvplan bench``: the scenarios of benchmarks.md, kvplan and the SGLang-style baseline side by side.

For each scenario one process plans the same batch both ways, checks that the descriptors are
equal, and measures (median of ``runs`` after warm-up):

* plan latency: from inputs on the device to descriptors in host memory (``gpu.plan(batch)
  .descriptors()``), and its parts: the ``plan`` call (host bookkeeping and launches), the device
  time (CUDA events) and the hand-off (waiting for the event, the error check, the copy);
* the baseline's latency to its descriptor array, and the ratio;
* synchronizing calls during ``plan`` (``torch.cuda.set_sync_debug_mode("error")``);
* with ``staging``: the gather and scatter kernels' bandwidth against ``torch`` ``copy_`` of the
  same number of bytes, on zero-filled pools of the scenario's real size (the two Llama scenarios:
  direct and head-sliced descriptors).

On a CPU the kernels run in Triton's interpreter: the numbers then only show that it works.

Example::

    rows = run_bench(["llama70b-tp8-p64"], runs=20)
    print(render(rows))
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import numpy as np
import torch

from .baseline import sglang_style_descs
from .planner import gpu
from .planner.device import Planner
from .planner.model import Batch
from .scenarios import PRESETS, build_batch, materialize
from .transport.local import gather, plan_alignment, scatter, staging_offsets

__all__ = ["SCENARIOS", "BenchRow", "TARGETS", "render", "run_bench"]

SCENARIOS: dict[str, tuple[int, int]] = {  # name -> (requests, prompt tokens), benchmarks.md
    "llama70b-tp8-p64": (32, 8192),
    "llama70b-tp8-p1": (8, 8192),
    "llama70b-tp4to8-p64": (8, 8192),
    "dsv32-mla-dsa-p64": (64, 4096),
    "gptoss-swa-p16": (32, 16384),
    "qwen3next-mamba-p64": (64, 4096),
}
STAGING_SCENARIOS = ("llama70b-tp8-p64", "llama70b-tp4to8-p64")  # direct and head-sliced; the others' pools are larger
TARGETS = {"ratio": 50.0, "ratio_high": 200.0, "high_ratio_scenarios": ("llama70b-tp8-p1", "llama70b-tp4to8-p64"),
           "latency_ms": 0.2, "latency_max_descs": 100_000, "staging_fraction": 0.85}


@dataclass
class BenchRow:
    scenario: str
    requests: int
    prompt_len: int
    layers: int
    descriptors: int
    baseline_ms: float
    kvplan_ms: float
    plan_call_ms: float | None
    device_ms: float | None
    handoff_ms: float | None
    syncs_during_plan: int | None
    ratio: float
    graph_ms: float | None = None
    graph_ratio: float | None = None
    gather_gbps: float | None = None
    scatter_gbps: float | None = None
    copy_gbps: float | None = None

    def targets_met(self) -> dict[str, bool]:
        """Which targets of benchmarks.md this row meets (empty off a GPU: the interpreter is no measure)."""
        if self.plan_call_ms is None:
            return {}
        high = self.scenario in TARGETS["high_ratio_scenarios"]
        best = min(x for x in (self.kvplan_ms, self.graph_ms) if x is not None)
        met = {"ratio": self.baseline_ms / best >= (TARGETS["ratio_high"] if high else TARGETS["ratio"])}
        if self.descriptors <= TARGETS["latency_max_descs"]:
            met["latency"] = best <= TARGETS["latency_ms"]
        if self.syncs_during_plan is not None:
            met["no_sync"] = self.syncs_during_plan == 0
        if self.gather_gbps and self.copy_gbps:
            met["staging"] = min(self.gather_gbps, self.scatter_gbps) >= TARGETS["staging_fraction"] * self.copy_gbps
        return met


def median_ms(fn: Callable[[], object], runs: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in ms, device work included (synchronised around each run)."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    times = []
    for _ in range(runs):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:  # device work launched by fn counts until it is done
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _parts_ms(batch: Batch, runs: int) -> tuple[float, float, float]:
    """Median (plan call, device time, hand-off) in ms, on CUDA."""
    call, device, handoff = [], [], []
    for _ in range(runs):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        pending = gpu.plan(batch)
        end.record()
        t1 = time.perf_counter()
        pending.descriptors()
        t2 = time.perf_counter()
        call.append(t1 - t0)
        handoff.append(t2 - t1)
        device.append(start.elapsed_time(end) / 1e3)
    return tuple(statistics.median(x) * 1e3 for x in (call, device, handoff))


def _syncs_during_plan(batch: Batch) -> int:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu.plan(batch)
        return 0
    except RuntimeError:
        return 1
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _staging_gbps(batch: Batch, device: torch.device, runs: int) -> tuple[float, float, float]:
    """Gather, scatter and plain copy bandwidth (GB/s, bytes read + written) on real pools."""
    src, _src_mem = materialize(batch.src, device)
    dst, _dst_mem = materialize(batch.dsts[0], device)
    real = replace(batch, src=src, dsts=(dst,)).to(device)
    descs = gpu.plan(real).device_descriptors()
    offsets, ends = staging_offsets(descs)
    nbytes = int(ends[-1])
    staging = torch.empty(nbytes, dtype=torch.uint8, device=device)
    twin = torch.empty_like(staging)
    align = plan_alignment(real)
    typical = int(descs[:, 2].float().mean().item())
    g = median_ms(lambda: gather(descs, offsets, staging, align, typical), runs)
    s = median_ms(lambda: scatter(descs, offsets, staging, align, typical), runs)
    c = median_ms(lambda: twin.copy_(staging), runs)
    return tuple(2 * nbytes / (ms / 1e3) / 1e9 for ms in (g, s, c))


def run_bench(names: list[str], runs: int = 20, scale: float = 1.0, staging: bool = False,
              progress: Callable[[str], None] | None = None) -> list[BenchRow]:
    """Measure each scenario; ``scale`` < 1 shrinks requests, tokens and layers (for CPU runs)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for name in names:
        if progress:
            progress(name)
        requests, prompt_len = SCENARIOS[name]
        shape = PRESETS[name]
        if scale < 1:
            requests, prompt_len = max(1, int(requests * scale)), max(64, int(prompt_len * scale))
            shape = shape.scaled(layers=max(1, int(shape.layers * scale)))
        batch = build_batch(shape, requests, prompt_len, seed=0)
        device_batch = batch.to(device)
        ours = gpu.plan(device_batch).descriptors()[0]
        theirs = sglang_style_descs(batch)
        if not np.array_equal(ours, theirs):
            raise AssertionError(f"{name}: kvplan and the SGLang-style baseline planned different descriptors")
        kvplan_ms = median_ms(lambda: gpu.plan(device_batch).descriptors(), runs)
        base_runs = max(3, min(runs, int(2000 / max(1.0, median_ms(lambda: sglang_style_descs(batch), 1, 0)))))
        baseline_ms = median_ms(lambda: sglang_style_descs(batch), base_runs, warmup=1)
        call = dev = handoff = syncs = graph_ms = None
        if device.type == "cuda":
            call, dev, handoff = _parts_ms(device_batch, runs)
            syncs = _syncs_during_plan(device_batch)
            planner = GraphPlanner()
            if not np.array_equal(planner.plan(device_batch).descriptors()[0], ours):  # eager, then captured
                raise AssertionError(f"{name}: the graph planner disagrees with the eager planner")
            graph_ms = median_ms(lambda: planner.plan(device_batch).descriptors(), runs)
        row = BenchRow(name, requests, prompt_len, shape.layers, len(ours), baseline_ms, kvplan_ms, call, dev,
                       handoff, syncs, baseline_ms / kvplan_ms, graph_ms,
                       baseline_ms / graph_ms if graph_ms else None)
        if staging and device.type == "cuda" and name in STAGING_SCENARIOS:
            row.gather_gbps, row.scatter_gbps, row.copy_gbps = _staging_gbps(batch, device, runs)
        rows.append(row)
    return rows


def render(rows: list[BenchRow]) -> str:
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU, Triton interpreter (not a speed measurement)"
    fmt = lambda v, spec=".3f": "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"card: {card}; torch {torch.__version__}",
             "| scenario | descriptors | SGLang-style ms | kvplan ms | plan() call ms | device ms | hand-off ms | "
             "ratio | graph ms | graph ratio | syncs | gather / scatter / copy GB/s | targets |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        staging = "-" if r.gather_gbps is None else f"{r.gather_gbps:.0f} / {r.scatter_gbps:.0f} / {r.copy_gbps:.0f}"
        met = ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in r.targets_met().items()) or "-"
        lines.append(f"| {r.scenario} | {r.descriptors:,} | {r.baseline_ms:.2f} | {r.kvplan_ms:.3f} | "
                     f"{fmt(r.plan_call_ms)} | {fmt(r.device_ms)} | {fmt(r.handoff_ms)} | {r.ratio:.1f}x | "
                     f"{fmt(r.graph_ms)} | {fmt(r.graph_ratio, '.1f')}{'x' if r.graph_ratio else ''} | "
                     f"{fmt(r.syncs_during_plan, 'd')} | {staging} | {met} |")
    return "\n".join(lines)


def rows_as_dicts(rows: list[BenchRow]) -> list[dict]:
    return [{**asdict(r), "targets_met": r.targets_met()} for r in rows]


def progress_printer(total: int) -> Callable[[str], None]:
    state = {"done": 0}

    def show(name: str) -> None:
        state["done"] += 1
        bar = "#" * state["done"] + "." * (total - state["done"])
        sys.stderr.write(f"\r[{bar}] {state['done']}/{total} {name:<24}")
        sys.stderr.flush()

    return show
