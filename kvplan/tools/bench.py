"""``kvplan bench``: the scenarios of benchmarks.md, kvplan against the strongest host planners.

For each scenario one process plans the same batch every way, checks that every output equals
kvplan's, then measures (median of ``runs`` after warm-up, GPU otherwise idle):

* the baselines (``kvplan.tools.host_baselines``, ``kvplan.tools.baseline``): ``numpy-batch`` with one thread
  and with a pool (the best is the headline baseline), ``prepared-ids`` (NIXL prepared lists as
  vLLM and SGLang build them) and ``sglang-loop`` (SGLang's Mooncake path; kept for continuity);
* kvplan, from the call to the output in host memory: eager (:class:`Planner` without graphs) and
  graph replay, for the Nx3 descriptors, the prepared indices and the compact runs form. The graph
  latency is also taken over 200 batches of varying shapes within one bucket (median and p99);
* the floor: kvplan's kernel time (a counts-only graph replay, CUDA events) plus the copy of each
  output form at the card's measured pinned device-to-host bandwidth;
* the host CPU time of ``plan`` (thread time), how long ``plan`` takes to return while the
  stream is busy (a queued ``torch.cuda._sleep``), and how long the SGLang-style ``.cpu()`` blocks
  the same thread;
* with ``staging``: the gather and scatter kernels' bandwidth against ``torch`` ``copy_``.

On a CPU the kernels run in Triton's interpreter: the numbers then only show that it works.

Example::

    rows = run_bench(["llama70b-tp8-p64"], runs=20)
    print(render(rows))
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from .baseline import sglang_style_descs
from .host_baselines import NumpyBatchPlanner, prepared_ids
from ..planner.device import eager
from ..planner.device.columns import BatchColumns
from ..planner.device.planner import Planner
from ..planner.contract.batch import Batch
from ..planner.contract.pairing import Mode, pair_sides
from .scenarios import PRESETS, build_batch, materialize
from .scenarios import SCENARIOS as _SCENARIOS
from ..transport.local import gather, plan_alignment, scatter, staging_offsets

__all__ = ["SCENARIOS", "BenchRow", "TARGETS", "render", "run_bench", "scenario_batch"]

# name -> (requests, prompt tokens), from the one list of scenarios (docs/benchmarks.md)
SCENARIOS: dict[str, tuple[int, int]] = {s.name: (s.requests, s.prompt_len) for s in _SCENARIOS.values()}
# scenarios whose decode side has another page size (docs/page_sizes.md): name -> (preset, its page size)
DST_PAGE_SIZES = {s.name: (s.preset, s.dst_page_size) for s in _SCENARIOS.values() if s.dst_page_size}
STAGING_SCENARIOS = ("llama70b-tp8-p64", "llama70b-tp4to8-p64")  # direct and head-sliced; the others' pools are larger
TARGETS = {"ratio": 10.0, "floor_factor": 1.5, "latency_ms": {"qwen3next-mamba-p64": 0.15, "llama70b-tp8-p64": 0.3},
           "host_cpu_us": 50.0, "busy_return_us": 50.0, "staging_fraction": 0.85}
POOL_THREADS = 8


@dataclass
class BenchRow:
    scenario: str
    requests: int
    prompt_len: int
    layers: int
    descriptors: int
    baselines: dict[str, float]  # name -> ms
    kvplan_ms: float  # eager, Nx3 descriptors to host
    kvplan_graph_ms: float | None = None  # graph replay, Nx3 descriptors to host
    graph_p50_ms: float | None = None  # over varying batches within one bucket
    graph_p99_ms: float | None = None
    prepared_ms: float | None = None  # graph replay, prepared indices to host
    runs_ms: float | None = None  # graph replay, compact runs to host
    kernel_ms: float | None = None  # counts-only graph replay, device time
    d2h_gbps: float | None = None
    floor_ms: float | None = None  # kernel + Nx3 copy at d2h_gbps
    floor_runs_ms: float | None = None
    host_cpu_us: float | None = None
    busy_return_us: float | None = None
    cpu_blocks_ms: float | None = None  # the .cpu() path, same busy stream
    num_runs: int = 0
    gather_gbps: float | None = None
    scatter_gbps: float | None = None
    copy_gbps: float | None = None
    ratios: dict[str, float] = field(default_factory=dict)

    @property
    def strongest(self) -> str:
        return "numpy-batch"

    @property
    def best_ms(self) -> float:
        return min(x for x in (self.kvplan_ms, self.kvplan_graph_ms) if x is not None)

    def compute_ratios(self) -> None:
        self.ratios = {"descriptors": self.baselines["numpy-batch"] / self.best_ms}
        if "sglang-loop" in self.baselines:  # none where SGLang refuses the pairing (different page sizes)
            self.ratios["vs_sglang_loop"] = self.baselines["sglang-loop"] / self.best_ms
        if self.prepared_ms and "prepared-ids" in self.baselines:
            self.ratios["prepared"] = self.baselines["prepared-ids"] / self.prepared_ms
        if self.runs_ms and "numpy-batch-runs" in self.baselines:
            self.ratios["runs"] = self.baselines["numpy-batch-runs"] / self.runs_ms

    def targets_met(self) -> dict[str, bool]:
        """Which targets of benchmarks.md this row meets (empty off a GPU: the interpreter is no measure)."""
        if self.kernel_ms is None:
            return {}
        met = {"ratio_or_floor": self.ratios["descriptors"] >= TARGETS["ratio"]
               or self.best_ms <= TARGETS["floor_factor"] * self.floor_ms}
        if "prepared" in self.ratios or "runs" in self.ratios:
            met["compact_ratio"] = max(self.ratios.get("prepared", 0), self.ratios.get("runs", 0)) >= TARGETS["ratio"]
        limit = TARGETS["latency_ms"].get(self.scenario)
        if limit is not None and self.graph_p99_ms is not None:
            met["latency_p50_p99"] = max(self.graph_p50_ms, self.graph_p99_ms) <= limit
        met["host_cpu"] = self.host_cpu_us <= TARGETS["host_cpu_us"]
        met["busy_return"] = self.busy_return_us <= TARGETS["busy_return_us"]
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


def _staging_gbps(batch: Batch, device: torch.device, runs: int) -> tuple[float, float, float]:
    """Gather, scatter and plain copy bandwidth (GB/s, bytes read + written) on real pools."""
    src, _src_mem = materialize(batch.src, device)
    dst, _dst_mem = materialize(batch.dsts[0], device)
    real = replace(batch, src=src, dsts=(dst,)).to(device)
    descs = eager.plan(real).device_descriptors()
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


def scenario_batch(name: str, scale: float = 1.0) -> tuple[Batch, int, int, int]:
    """A scenario's batch (and its requests, prompt length, layers), shrunk by ``scale`` < 1."""
    requests, prompt_len = SCENARIOS[name]
    preset, dst_page_size = DST_PAGE_SIZES.get(name, (name, None))
    shape = PRESETS[preset]
    if scale < 1:
        requests, prompt_len = max(1, int(requests * scale)), max(64, int(prompt_len * scale))
        shape = shape.scaled(layers=max(1, int(shape.layers * scale)))
    return (build_batch(shape, requests, prompt_len, seed=0, dst_page_size=dst_page_size), requests, prompt_len,
            shape.layers)


def _varying(batch: Batch, count: int, seed: int = 1) -> list[BatchColumns]:
    """Column sets of random subsets of the batch's transfers that stay in the full batch's bucket."""
    full = BatchColumns.from_batch(batch)
    bucket = (_pow2(full.num_transfers), _pow2(len(full.dst_flat)))
    rng = np.random.default_rng(seed)
    out, T = [], len(batch.transfers)
    for _ in range(count * 4):
        keep = np.sort(rng.choice(T, size=int(rng.integers(T // 2 + 1, T + 1)), replace=False))
        cols = BatchColumns.from_batch(replace(batch, transfers=tuple(batch.transfers[i] for i in keep)))
        if (_pow2(cols.num_transfers), _pow2(len(cols.dst_flat))) == bucket:
            out.append(cols)
        if len(out) == count:
            break
    return out or [full]


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _latencies_ms(planner: Planner, sets: list[BatchColumns], runs: int, read: Callable) -> np.ndarray:
    """Call-to-host-result latency per plan, GPU idle before each call."""
    out = []
    for i in range(runs):
        cols = sets[i % len(sets)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        read(planner.plan(cols))
        out.append(time.perf_counter() - t0)
    return np.array(out) * 1e3


def _d2h_gbps(device: torch.device, nbytes: int = 1 << 28) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times) / 1e9


def device_span_ms(planner: Planner, cols: BatchColumns, runs: int, hold_ms: float = 2.0) -> float:
    """Median ms of a plan's device work alone (the bench's kernel time: a counts-only graph replay).

    A sleep of ``hold_ms`` is queued before the start event, so the host fills the columns and
    launches the plan while the GPU is still busy; the events then time the device work only, not
    the host's part of ``plan`` (an idle GPU would record the start event at once and wait for it).
    The host must finish ``plan`` within the hold; a slower call raises, since its span would
    count host time again."""
    cycles = int(hold_ms * 1e-3 * torch.cuda.get_device_properties(planner.device).clock_rate * 1e3)
    times = []
    for i in range(runs + 3):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        planner.plan(cols)
        end.record()
        if i >= 3 and start.query():  # (the first calls compile and capture)
            raise AssertionError(f"the host took longer than the {hold_ms} ms hold to plan; raise hold_ms")
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def _busy_stream(planner: Planner, cols: BatchColumns, table: torch.Tensor, samples: int = 5) -> tuple[float, float]:
    """Medians of ``samples``: (us for ``plan`` to return, ms the ``.cpu()`` path blocks), 20 ms queued first."""
    cycles = int(20e-3 * torch.cuda.get_device_properties(table.device).clock_rate * 1e3)
    returned, blocked = [], []
    for _ in range(samples):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        pending = planner.plan(cols)
        returned.append(time.perf_counter() - t0)
        still_busy = not pending.ready()
        pending.descriptors()
        if not still_busy:
            raise AssertionError("the plan's event fired before the queued sleep ended: the check cannot fail")
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        table[1, :64].cpu()
        blocked.append(time.perf_counter() - t0)
    return statistics.median(returned) * 1e6, statistics.median(blocked) * 1e3


def _host_cpu_us(planner: Planner, cols: BatchColumns, runs: int) -> float:
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.thread_time()
        pending = planner.plan(cols)
        times.append(time.thread_time() - t0)
        pending.descriptors()
    return statistics.median(times) * 1e6


def run_bench(names: list[str], runs: int = 20, scale: float = 1.0, staging: bool = False,
              progress: Callable[[str], None] | None = None) -> list[BenchRow]:
    """Measure each scenario; ``scale`` < 1 shrinks requests, tokens and layers (for CPU runs)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for name in names:
        if progress:
            progress(name)
        batch, requests, prompt_len, layers = scenario_batch(name, scale)
        device_batch = batch.to(device)
        cols = BatchColumns.from_batch(device_batch)
        same_pages = all(d.kv.page_size == batch.src.kv.page_size for d in batch.dsts)
        # prepared lists are per page of equal size; SGLang refuses different page sizes
        direct = same_pages and all(pair_sides(batch.src, d).mode is Mode.DIRECT for d in batch.dsts)
        ours = eager.plan(device_batch).descriptors()[0]
        one = NumpyBatchPlanner(device_batch.src, device_batch.dsts)
        pool = NumpyBatchPlanner(device_batch.src, device_batch.dsts, threads=POOL_THREADS)
        for planner, what in ((one, "numpy-batch"), (pool, "numpy-batch (pool)")):
            if not np.array_equal(planner.plan(cols)[0], ours):
                raise AssertionError(f"{name}: {what} and kvplan planned different descriptors")
        if same_pages and not np.array_equal(sglang_style_descs(batch), ours):
            raise AssertionError(f"{name}: sglang-loop and kvplan planned different descriptors")
        base = {"numpy-batch-1": median_ms(lambda: one.plan(cols), runs),
                f"numpy-batch-{POOL_THREADS}": median_ms(lambda: pool.plan(cols), runs),
                "numpy-batch-runs": median_ms(lambda: one.runs(cols), runs)}
        base["numpy-batch"] = min(base["numpy-batch-1"], base[f"numpy-batch-{POOL_THREADS}"])
        if direct:
            want = eager.plan(device_batch, prepared=True).prepared_indices()
            got = prepared_ids(device_batch.src, device_batch.dsts, cols)
            if not (np.array_equal(got[0], want.src) and np.array_equal(got[1], want.dst)):
                raise AssertionError(f"{name}: prepared-ids and kvplan's prepared indices differ")
            base["prepared-ids"] = median_ms(lambda: prepared_ids(device_batch.src, device_batch.dsts, cols), runs)
        if same_pages:
            loop_runs = max(3, min(runs, int(2000 / max(1.0, median_ms(lambda: sglang_style_descs(batch), 1, 0)))))
            base["sglang-loop"] = median_ms(lambda: sglang_style_descs(batch), loop_runs, warmup=1)
        no_graphs = Planner(device_batch.src, device_batch.dsts, graphs=False)
        row = BenchRow(name, requests, prompt_len, layers, len(ours), base,
                       median_ms(lambda: no_graphs.plan(cols).descriptors(), runs), num_runs=runs)
        if device.type == "cuda":
            _gpu_measures(row, device_batch, cols, ours, runs, direct)
        row.compute_ratios()
        if staging and device.type == "cuda" and name in STAGING_SCENARIOS:
            row.gather_gbps, row.scatter_gbps, row.copy_gbps = _staging_gbps(batch, device, runs)
        rows.append(row)
    return rows


def _gpu_measures(row: BenchRow, batch: Batch, cols: BatchColumns, ours: np.ndarray, runs: int, direct: bool) -> None:
    src, dsts = batch.src, batch.dsts
    graph = Planner(src, dsts, graphs=True)
    for _ in range(3):  # eager (compiles), capture, replay
        if not np.array_equal(graph.plan(cols).descriptors()[0], ours):
            raise AssertionError(f"{row.scenario}: graph replay and eager planning disagree")
    row.kvplan_graph_ms = median_ms(lambda: graph.plan(cols).descriptors(), runs)
    sets = _varying(batch, 10)
    lat = _latencies_ms(graph, sets, 200, lambda p: p.descriptors())
    row.graph_p50_ms, row.graph_p99_ms = float(np.median(lat)), float(np.percentile(lat, 99))
    row.host_cpu_us = _host_cpu_us(graph, cols, runs)
    row.busy_return_us, row.cpu_blocks_ms = _busy_stream(graph, cols, src.req_to_token)
    counts = Planner(src, dsts, graphs=True, outputs=())
    row.kernel_ms = device_span_ms(counts, cols, runs)
    row.d2h_gbps = _d2h_gbps(src.req_to_token.device)
    row.floor_ms = row.kernel_ms + len(ours) * 24 / row.d2h_gbps / 1e6
    runs_planner = Planner(src, dsts, graphs=True, outputs=("runs",))
    for _ in range(3):
        compact = runs_planner.plan(cols).runs()
    host_runs = NumpyBatchPlanner(src, dsts).runs(cols)[0]
    if not np.array_equal(compact.runs, host_runs):
        raise AssertionError(f"{row.scenario}: the compact runs of kvplan and numpy-batch differ")
    row.runs_ms = median_ms(lambda: runs_planner.plan(cols).runs(), runs)
    row.floor_runs_ms = row.kernel_ms + len(host_runs) * 24 / row.d2h_gbps / 1e6
    if direct:
        prepared = Planner(src, dsts, graphs=True, outputs=("prepared",))
        for _ in range(3):
            prepared.plan(cols).prepared_indices()
        row.prepared_ms = median_ms(lambda: prepared.plan(cols).prepared_indices(), runs)


def render(rows: list[BenchRow]) -> str:
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU, Triton interpreter (not a speed measurement)"
    fmt = lambda v, spec=".3f": "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"card: {card}; torch {torch.__version__}; ratios against numpy-batch (the strongest host planner), "
             "the same Nx3 output checked equal first",
             "| scenario | descriptors | numpy-batch ms (1 / pool) | kvplan eager ms | kvplan graph ms | ratio | "
             "p50 / p99 ms | kernel ms | floor ms | prepared-ids / kvplan ms | numpy runs / kvplan ms | host CPU us | "
             "busy return us / .cpu() blocks ms | sglang-loop ms | targets |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r.baselines
        met = ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in r.targets_met().items()) or "-"
        prep = f"{b['prepared-ids']:.2f} / {fmt(r.prepared_ms)}" if "prepared-ids" in b else "-"
        lines.append(
            f"| {r.scenario} | {r.descriptors:,} | {b['numpy-batch-1']:.2f} / {b[f'numpy-batch-{POOL_THREADS}']:.2f} | "
            f"{r.kvplan_ms:.3f} | {fmt(r.kvplan_graph_ms)} | {r.ratios['descriptors']:.1f}x | "
            f"{fmt(r.graph_p50_ms)} / {fmt(r.graph_p99_ms)} | {fmt(r.kernel_ms)} | {fmt(r.floor_ms)} | {prep} | "
            f"{b['numpy-batch-runs']:.2f} / {fmt(r.runs_ms)} | {fmt(r.host_cpu_us, '.0f')} | "
            f"{fmt(r.busy_return_us, '.0f')} / {fmt(r.cpu_blocks_ms, '.1f')} | {fmt(b.get('sglang-loop'), '.1f')} | {met} |")
    if any(r.gather_gbps for r in rows):
        lines += ["", "| scenario | gather / scatter / copy GB/s |", "|---|---|"]
        lines += [f"| {r.scenario} | {r.gather_gbps:.0f} / {r.scatter_gbps:.0f} / {r.copy_gbps:.0f} |"
                  for r in rows if r.gather_gbps]
    return "\n".join(lines)


def rows_as_dicts(rows: list[BenchRow]) -> list[dict]:
    """JSON rows: every field, ``kvplan_ms``/``kvplan_graph_ms``/``floor_ms``, the ``baselines`` and ``ratios``."""
    return [{**asdict(r), "strongest_baseline": r.strongest, "targets_met": r.targets_met()} for r in rows]


def progress_printer(total: int) -> Callable[[str], None]:
    state = {"done": 0}

    def show(name: str) -> None:
        state["done"] += 1
        bar = "#" * state["done"] + "." * (total - state["done"])
        sys.stderr.write(f"\r[{bar}] {state['done']}/{total} {name:<24}")
        sys.stderr.flush()

    return show
