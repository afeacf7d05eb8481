"""The ``kvplan`` command line: ``kvplan demo`` (also ``python -m kvplan demo``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from . import __version__
from .scenarios import PRESETS
from .transport.endpoints import MODES
from .transport.engines import engine_names

log = logging.getLogger("kvplan")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (pages per allocator run), got {value}")
    return value


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    config = DemoConfig(preset=args.preset, layers=args.layers, requests=args.requests, prompt_len=args.prompt_len,
                        chunks=args.chunks, prefix_len=args.prefix_len, mean_run=args.fragmentation,
                        engine=args.engine, mode=args.mode, device=args.device, seed=args.seed, timeout=args.timeout,
                        fault=args.fault, repeat=args.repeat, engine_threads=args.engine_threads, staging_bytes=args.staging_mib << 20)
    if config.mode == "prepared" and config.engine != "nixl":
        raise SystemExit("kvplan demo: error: --mode prepared needs --engine nixl (prepared lists are NIXL's)")
    shape = config.model()
    if config.prefix_len % shape.page_size:
        raise SystemExit(f"kvplan demo: error: --prefix-len must be a multiple of the page size {shape.page_size}")
    report = run_demo(config, progress=not args.no_progress)
    sys.stdout.write(report.render() + "\n")
    return 0 if report.ok else 1


def _bench(args: argparse.Namespace) -> int:
    import json

    from .bench import SCENARIOS, progress_printer, render, rows_as_dicts, run_bench

    names = args.scenario or list(SCENARIOS)
    show = None if args.no_progress else progress_printer(len(names))
    rows = run_bench(names, runs=args.runs, scale=args.scale, staging=args.staging, progress=show)
    if show:
        sys.stderr.write("\n")
    sys.stdout.write(render(rows) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_as_dicts(rows), f, indent=2)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvplan", description="GPU-resident KV-cache transfer planning.")
    parser.add_argument("--version", action="version", version=f"kvplan {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    from .demo import FAULTS

    demo = sub.add_parser(
        "demo", help="a real prefill-to-decode hand-off on this machine, verified byte for byte",
        description="Starts a decode and a prefill process on 127.0.0.1 with model-shaped, fragmented paged pools "
                    "(GPU memory when a GPU is present), plans the batch with kvplan, moves it through a real engine "
                    "and checks every byte on the decode side. Exits 1 if any request fails or any byte is wrong.")
    demo.add_argument("--preset", choices=sorted(PRESETS), default="gptoss-swa-p16",
                      help="model shape from docs/benchmarks.md, at small scale (default: %(default)s)")
    demo.add_argument("--layers", type=_positive, default=4, help="layers to keep (default: 4)")
    demo.add_argument("--requests", type=_positive, default=8, help="requests in the batch (default: 8)")
    demo.add_argument("--prompt-len", type=_positive, default=2048, help="tokens per request (default: 2048)")
    demo.add_argument("--chunks", type=_positive, default=2, help="chunks per request (default: 2)")
    demo.add_argument("--prefix-len", type=int, default=0,
                      help="tokens the decode side already holds, page aligned (default: 0)")
    demo.add_argument("--fragmentation", type=_fraction, default=None,
                      help="mean length in pages of the allocator's free runs; lower is more fragmented "
                           "(default: the preset's)")
    demo.add_argument("--engine", choices=engine_names(), default="nixl", help="transfer engine (default: nixl)")
    demo.add_argument("--mode", choices=list(MODES), default="auto",
                      help="direct: one engine write per section, all posted at once; prepared: NIXL prepared lists "
                           "and int32 indices; staged: waves through a ring of staging slots; auto: staged for many "
                           "small descriptors when both sides have staging buffers, else direct (default: auto)")
    demo.add_argument("--repeat", type=_positive, default=1,
                      help="send the batch this many times (new request ids each time); reports the first batch "
                           "and the median of the others (default: 1)")
    demo.add_argument("--engine-threads", type=int, default=0,
                      help="NIXL's UCX worker threads (default: 0, NIXL's own default)")
    demo.add_argument("--staging-mib", type=_positive, default=64,
                      help="staging buffer per side, in MiB, for staged and auto modes (default: 64)")
    demo.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                      help="where the pools live; auto picks the GPU when there is one (default: auto)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the allocation and the bytes (default: 0)")
    demo.add_argument("--timeout", type=float, default=60.0, help="deadline of every wait, in seconds (default: 60)")
    demo.add_argument("--fault", choices=FAULTS, default="none",
                      help="drill a failure path: the decode or prefill process dies, the layouts do not pair, or "
                           "nothing is sent before the deadline (default: none)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar on standard error")
    demo.set_defaults(run=_demo)

    from .bench import SCENARIOS

    bench = sub.add_parser(
        "bench", help="plan latency against the strongest host planners for the scenarios of docs/benchmarks.md",
        description="Plans each scenario with kvplan and with the SGLang-style baseline in this process, checks "
                    "that the descriptors are equal, and reports medians, the ratio and which targets are met. "
                    "Without a GPU the kernels run in Triton's interpreter: use --scale to keep it short.")
    bench.add_argument("--scenario", action="append", choices=list(SCENARIOS),
                       help="a scenario to run (repeatable; default: all)")
    bench.add_argument("--runs", type=_positive, default=20, help="timed runs per measurement (default: 20)")
    bench.add_argument("--scale", type=float, default=1.0,
                       help="shrink requests, tokens and layers by this factor, e.g. 0.02 on a CPU (default: 1)")
    bench.add_argument("--staging", action="store_true",
                       help="also measure the staging gather/scatter against a device-to-device copy (GPU)")
    bench.add_argument("--json", help="write the results as JSON to this file")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar on standard error")
    bench.set_defaults(run=_bench)
    return parser


def _use_interpreter_without_gpu() -> None:
    """Without a GPU the kernels run in Triton's interpreter; the variable must precede their import."""
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"


def main(argv: list[str] | None = None) -> int:
    _use_interpreter_without_gpu()  # before anything imports the kernels
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    return args.run(args)
