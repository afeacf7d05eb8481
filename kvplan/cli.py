"""The ``kvplan`` command line: ``kvplan demo`` (also ``python -m kvplan demo``)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

import numpy as np

from .planner.reference import plan_reference
from .scenarios import PRESETS, build_batch

log = logging.getLogger("kvplan")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _demo(args: argparse.Namespace) -> int:
    shape = PRESETS[args.preset].scaled(layers=args.layers)
    batch = build_batch(shape, args.requests, args.prompt_len, chunks=args.chunks, seed=args.seed)
    t0 = time.perf_counter()
    plan = plan_reference(batch)
    elapsed = time.perf_counter() - t0
    descs, _ = plan.descriptors()
    nbytes = int(descs[:, 2].sum()) if len(descs) else 0
    runs = sum(len(t.runs) for t in plan.transfers)
    components = sorted({c.name for t in plan.transfers for c in t.state})
    out = sys.stdout
    out.write(f"kvplan demo: {shape.name} at {shape.layers} layers, page size {shape.page_size}\n")
    out.write(f"  requests {args.requests} x {args.prompt_len} tokens, {len(batch.transfers)} chunks, "
              f"mode {plan.transfers[0].mode.value}\n")
    out.write(f"  KV runs {runs}, descriptors {len(descs):,}, bytes {nbytes:,}\n")
    out.write(f"  state components: {', '.join(components) or 'none (dense model)'}\n")
    out.write(f"  planned by the NumPy reference in {elapsed * 1e3:.1f} ms\n")
    first = plan.transfers[-1]
    out.write(f"  last chunk of {first.request}: pages {first.src_pages[:6].tolist()}... -> "
              f"{first.dst_pages[:6].tolist()}..., {first.num_descs} descriptors\n")
    np.set_printoptions(formatter={"int": hex})
    out.write(f"  first descriptors (src, dst, nbytes):\n{descs[:3]}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvplan", description="GPU-resident KV-cache transfer planning.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="plan a batch of a model-shaped scenario and report it")
    demo.add_argument("--preset", choices=sorted(PRESETS), default="gptoss-swa-p16",
                      help="model shape from benchmarks.md (default: %(default)s)")
    demo.add_argument("--layers", type=_positive, default=4, help="layers to keep, a small-scale model (default: 4)")
    demo.add_argument("--requests", type=_positive, default=8, help="requests in the batch (default: 8)")
    demo.add_argument("--prompt-len", type=_positive, default=2048, help="tokens per request (default: 2048)")
    demo.add_argument("--chunks", type=_positive, default=2, help="chunks per request (default: 2)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the fragmented allocation (default: 0)")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    return args.run(args)
