"""Streaming in layer groups on a GPU (issue 15, docs/layerwise.md §5).

1. What the readiness signal costs the forward pass: a run of marks alone, then the stand-in
   forward pass with and without its marks (CUDA events around each, medians), and a forward pass
   captured in a CUDA graph and replayed (the marks must count in every replay).
2. Time to decode-ready: ``kvplan demo`` with the stand-in forward pass, 8k tokens, each preset's
   full depth; the batch sent after the pass (``auto`` and ``direct``) and streamed in several
   group counts. The exposed transfer is decode-ready minus the end of the forward pass.

Usage (on the GPU machine, engine wheels installed)::

    python3 benchmarks/layerwise.py --out /tmp/out [--engine nixl] [--decode-gpu 0 --decode-gpu 1]
        [--modes staged] [--repeat 8] [--staging 64:4 --staging 256:2] [--skip-signal]
        [--progress-thread on --progress-thread off] [--split even --split tapered]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvplan.planner.contract.layer_groups import LayerGroups  # noqa: E402
from kvplan.tools.demo import DemoConfig, run_demo  # noqa: E402
from kvplan.tools.forward import StandInForward  # noqa: E402
from kvplan.tools.scenarios import PRESETS, build_batch, materialize  # noqa: E402

# (preset, stand-in matmul dim, group counts): Llama-70B on TP 8 holds ~107M weights per layer and
# rank (dim 10240: 1.7 TFLOP per layer at 8k tokens); gpt-oss-120b ~142M active weights per layer,
# two model layers per preset layer (dim 16896)
CASES = (("llama70b-tp8-p64", 10240, (4, 8)), ("gptoss-swa-p16", 16896, (3, 6)))
TOKENS = 8192


def _stream_ms(fn, reps: int) -> float:
    """Median GPU time of ``fn`` enqueued on the current stream (CUDA events)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def signal_cost(preset: str, dim: int, groups: int) -> dict:
    shape = PRESETS[preset]
    batch = build_batch(shape, requests=1, prompt_len=TOKENS)
    side, tensors = materialize(batch.src, "cuda", seed=0)
    group_of = LayerGroups.even(shape.layers, groups)
    with_marks = StandInForward(side, tensors, group_of, dim, TOKENS)
    without = StandInForward(side, tensors, group_of, dim, TOKENS, marks=False)
    with_marks.run(), without.run()
    torch.cuda.synchronize()
    plain_runs, marked_runs = [], []
    for _ in range(7):  # interleaved, so that drift hits both alike
        plain_runs.append(_stream_ms(without.run, 1))
        marked_runs.append(_stream_ms(with_marks.run, 1))
    plain, marked = statistics.median(plain_runs), statistics.median(marked_runs)
    signal = with_marks.readiness
    marks_alone = _stream_ms(lambda: [signal.mark(g % signal.groups) for g in range(1000)], 5) / 1000
    # a CUDA graph of the whole pass, marks included: each replay must count every group again
    graph_ok = None
    small = StandInForward(side, tensors, group_of, 256, 256)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        small.run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            small.run()
        counts = []
        for _ in range(3):
            small.readiness.reset()
            graph.replay()
            torch.cuda.synchronize()
            counts.append(small.readiness.ready())
        graph_ok = counts == [groups] * 3
        graph_note = f"replays counted {counts}"
    except Exception as err:  # noqa: BLE001 - reported: a capture that fails is a finding
        graph_note = f"capture failed: {type(err).__name__}: {err}"
    return {"preset": preset, "dim": dim, "groups": groups, "forward_ms": plain, "forward_marked_ms": marked,
            "per_mark_us": (marked - plain) * 1e3 / groups, "marks_alone_us": marks_alone * 1e3,
            "forward_range_ms": [min(plain_runs), max(plain_runs)], "marked_range_ms": [min(marked_runs), max(marked_runs)],
            "graph_ok": graph_ok, "graph": graph_note}


def graph_check(via: str) -> str:
    """Capture two marks in a CUDA graph with each way of writing the word; replay; count."""
    from kvplan.transport.readiness import LayerReadiness

    signal = LayerReadiness(2, "cuda", via=via)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            signal.mark(0)
        torch.cuda.synchronize()
        eager = signal.ready()
        signal.reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            signal.mark(0)
            signal.mark(1)
        counts = []
        for _ in range(3):
            signal.reset()
            graph.replay()
            torch.cuda.synchronize()
            counts.append(signal.ready())
        return f"{via}: eager mark read {eager}; replays counted {counts}"
    except Exception as err:  # noqa: BLE001 - a finding to report
        return f"{via}: failed: {type(err).__name__}: {err}"


def handoff(preset: str, dim: int, groups: int, mode: str, engine: str, decode_gpu: int = 0, repeat: int = 4,
            staging: tuple[int, int] = (64, 4), progress_thread: bool = True, split: str = "even") -> dict:
    config = DemoConfig(preset=preset, layers=PRESETS[preset].layers, requests=1, prompt_len=TOKENS, chunks=1,
                        engine=engine, mode=mode, layer_groups=groups, forward_dim=dim, repeat=repeat, timeout=40,
                        decode_gpu=decode_gpu, staging_bytes=staging[0] << 20, staging_slots=staging[1],
                        progress_thread=progress_thread, layer_split=split)
    t0 = time.monotonic()
    report = run_demo(config)
    return {"preset": preset, "groups": groups, "split": split if groups else None,
            "group_sizes": config.groups().sizes if groups else None, "mode": mode, "used": report.mode_used, "ok": report.ok,
            "descriptors": report.descriptors, "bytes": report.nbytes,
            "forward_ms": report.forward_s * 1e3 if report.forward_s is not None else None,
            "exposed_ms": report.exposed_s * 1e3 if report.exposed_s is not None else None,
            "exposed_each_ms": [round(x * 1e3, 3) for x in report.exposed_each_s], "decode_gpu": decode_gpu,
            "staging_mib_slots": list(staging), "progress_thread": progress_thread,
            "wall_s": time.monotonic() - t0, "failures": {str(k): v for k, v in report.failures.items() if v}}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/kvplan-layerwise")
    parser.add_argument("--engine", default="nixl")
    parser.add_argument("--skip-signal", action="store_true")
    parser.add_argument("--decode-gpu", type=int, action="append",
                        help="the decode process's GPU (repeatable: each hand-off runs on each; default 0)")
    parser.add_argument("--modes", default="staged,direct", help="the streamed modes to run (comma-separated)")
    parser.add_argument("--largest-only", action="store_true", help="stream in each preset's largest group count only")
    parser.add_argument("--repeat", type=int, default=4, help="batches per hand-off (the first is a warm-up)")
    parser.add_argument("--staging", action="append", metavar="MIB:SLOTS",
                        help="staging buffer and ring length (repeatable: each hand-off runs with each; default 64:4)")
    parser.add_argument("--split", action="append", choices=("even", "tapered"),
                        help="how streamed layers are split into groups (repeatable: each streamed hand-off runs with "
                             "each; default both)")
    parser.add_argument("--progress-thread", action="append", choices=("on", "off"),
                        help="NIXL's own progress thread (repeatable: each hand-off runs with each; default on)")
    args = parser.parse_args()
    streamed_modes = [m for m in args.modes.split(",") if m]
    os.makedirs(args.out, exist_ok=True)
    rows: dict = {"card": torch.cuda.get_device_name(), "engine": args.engine, "signal": [], "handoff": []}
    rows["graph_checks"] = [graph_check(via) for via in ("mapped", "copy")]
    print(rows["graph_checks"], flush=True)
    if not args.skip_signal:
        for preset, dim, counts in CASES:
            for groups in (counts[-1], PRESETS[preset].layers):
                row = signal_cost(preset, dim, groups)
                print(json.dumps(row), flush=True)
                rows["signal"].append(row)
    stagings = [tuple(int(x) for x in s.split(":")) for s in args.staging or ["64:4"]]
    threads = [p == "on" for p in args.progress_thread or ["on"]]
    for decode_gpu, staging, thread in [(d, s, p) for d in args.decode_gpu or [0] for s in stagings for p in threads]:
        for preset, dim, counts in CASES:
            after = [(0, "auto")] + ([(0, "direct")] if "direct" in streamed_modes else [])
            streamed = [(g, m, split) for g in (counts[-1:] if args.largest_only else counts) for m in streamed_modes
                        for split in args.split or ["even", "tapered"]]
            for groups, mode, split in [(g, m, "even") for g, m in after] + streamed:
                row = handoff(preset, dim, groups, mode, args.engine, decode_gpu, args.repeat, staging, thread, split)
                print(json.dumps(row), flush=True)
                rows["handoff"].append(row)
    with open(os.path.join(args.out, "layerwise.json"), "w") as out:
        json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
