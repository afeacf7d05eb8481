"""The ``kvplan`` command line: ``kvplan demo`` (also ``python -m kvplan demo``)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from dataclasses import replace
from typing import Any


def _use_interpreter_without_gpu() -> None:
    """Without a GPU the kernels run in Triton's interpreter. Triton reads the choice when a kernel is
    defined, so it is made here, before this module imports anything that defines one (``import
    kvplan`` alone defines none); an exported ``TRITON_INTERPRET`` is left as it is."""
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"


_use_interpreter_without_gpu()

from . import __version__  # noqa: E402 - after the interpreter's choice
from .tools import preflight  # noqa: E402
from .tools.demo_config import default_timeout as demo_timeout  # noqa: E402
from .tools.load_config import KV_SHAPES  # noqa: E402
from .tools.target_process import SideFailed  # noqa: E402
from .tools.scenarios import PRESETS, SCENARIOS  # noqa: E402
from .transport.endpoints import MODES  # noqa: E402
from .transport.engines import engine_names  # noqa: E402

log = logging.getLogger(__name__)

CPU_SCALE = 0.02  # kvplan bench's scale without a GPU


class Refused(Exception):
    """Options a command refuses before anything runs. :func:`main` writes the message on standard
    error and returns 2, argparse's code for a bad option (1 stays the code of a failed transfer or a
    wrong byte)."""

    def __init__(self, command: str, why: str):
        super().__init__(f"kvplan {command}: error: {why}")


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line hint in place of the whole usage on a bad option (exit code 2 as before)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n(see '{self.prog} --help')\n")


def _check_engine(command: str, engine: str, mode: str) -> None:
    """Refuse an engine that is not installed, or a mode it does not have, before any process starts."""
    from .transport.engines.registry import missing_engine

    if mode == "prepared" and engine != "nixl":
        raise Refused(command, "--mode prepared needs --engine nixl (prepared lists are NIXL's)")
    missing = missing_engine(engine)
    if missing:
        raise Refused(command, f"--engine {missing}")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _scale(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (a fraction of the full-size scenario), got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a share of the requests in [0, 1], got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (pages per allocator run), got {value}")
    return value


def _setting(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` for ``--engine-setting``: an integer where the value is one, else the text."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE with KEY a setting's name, got {text!r}")
    try:
        return key, int(value)
    except ValueError:
        return key, {"true": True, "false": False}.get(value.lower(), value)


def _ip(text: str) -> str:
    """An IP address (``--host``)."""
    import ipaddress

    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an IP address, got {text!r}") from None


def _address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IP address; IPv6 in brackets) for ``--listen`` and ``--peer``."""
    import ipaddress

    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with an IP address, got {text!r}") from None
    if not sep or not 0 < number < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port in 1..65535, got {text!r}")
    return host, number


def _check_demo(config, shape) -> None:
    """Refuse what cannot run before any process starts (each message says what to change)."""
    import torch

    def fail(why: str) -> None:
        raise Refused("demo", why)

    longest = max(config.prompt_len) if isinstance(config.prompt_len, tuple) else config.prompt_len
    grain = shape.page_size
    if config.dst_page_size:
        from .planner.contract.state_kinds import rules_of

        unmapped = [c.kind.value for c in shape.state if rules_of(c.kind).paged and not rules_of(c.kind).maps_pages]
        if unmapped:
            fail(f"--dst-page-size: {config.preset} has {unmapped[0]} state, which is not planned across page sizes "
                 "yet (docs/page_sizes.md §6)")
        grain = shape.page_size * config.dst_page_size // math.gcd(shape.page_size, config.dst_page_size)
    if config.tp is not None:  # pair a tiny batch of the same shape: what cannot pair is refused here
        from .errors import LayoutError
        from .planner.contract.pairing import pair_sides

        ts, td = config.tp
        heads = shape.num_kv_heads
        for flag, tp in (("--src-tp", ts), ("--dst-tp", td)):
            if shape.attention.slices_heads and heads % tp and tp % heads:  # as SGLang shards KV heads
                fail(f"{flag} {tp}: {config.preset}'s {heads} KV heads do not split over {tp} ranks (a TP size "
                     f"must divide the head count or be a multiple of it)")
        try:
            tiny = config.batch(requests=1, prompt_len=2 * shape.page_size)
            pair_sides(tiny.src, tiny.dsts[0])
        except LayoutError as err:
            fail(f"--src-tp {ts} --dst-tp {td}: {err}")
    if config.prefix_len < 0 or config.prefix_len % grain:
        fail(f"--prefix-len must be a non-negative multiple of {grain} (the page size, or the least common multiple "
             "of both sides' page sizes)")
    if config.prefix_len >= longest:
        fail(f"--prefix-len {config.prefix_len} must be shorter than the prompt ({longest} tokens)")
    if not config.timeout > 0:
        fail(f"--timeout must be positive, got {config.timeout}")
    if config.seed < 0:
        fail(f"--seed must be >= 0, got {config.seed}")
    pages = -(-longest // shape.page_size)
    if config.chunks > pages:
        fail(f"--chunks {config.chunks} needs a prompt of at least {config.chunks} pages, and --prompt-len {longest} "
             f"is {pages} page{'s' if pages > 1 else ''} of {shape.page_size} tokens: use a longer --prompt-len or "
             "fewer --chunks")
    if config.layers > PRESETS[config.preset].layers:
        fail(f"--layers {config.layers} is more than {config.preset}'s {PRESETS[config.preset].layers} layers")
    if config.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda, but torch sees no CUDA device here")
    device = config.resolved_device()
    if config.decode_gpu and (device != "cuda" or not 0 <= config.decode_gpu < torch.cuda.device_count()):
        fail(f"--decode-gpu {config.decode_gpu}: this machine has "
             f"{torch.cuda.device_count() if device == 'cuda' else 'no'} GPUs for the demo")
    entries = shape.layers * shape.attention.parts
    need = 2 * config.requests * longest * shape.token_bytes * entries  # both sides' KV pools, at least
    have = (torch.cuda.mem_get_info()[0] if device == "cuda"
            else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    if need > have // 2:
        fail(f"the pools need at least {need / 2**30:.1f} GiB and this machine has {have / 2**30:.1f} GiB free "
             f"({'GPU' if device == 'cuda' else 'host'}); use fewer --requests, a shorter --prompt-len or fewer "
             "--layers")


def _tp_sizes(args: argparse.Namespace) -> tuple[int, int] | None:
    """``(--src-tp, --dst-tp)`` when either is given (the other defaults to the preset's)."""
    if args.src_tp is None and args.dst_tp is None:
        return None
    shape = PRESETS[SCENARIOS[args.preset].preset]
    return (args.src_tp or shape.src_tp, args.dst_tp or shape.dst_tp)


def _demo(args: argparse.Namespace) -> int:
    from .tools.demo import DemoConfig, run_demo

    scenario = SCENARIOS[args.preset]
    config = DemoConfig(preset=scenario.preset, layers=args.layers, requests=args.requests, prompt_len=args.prompt_len,
                        chunks=args.chunks, prefix_len=args.prefix_len, mean_run=args.fragmentation,
                        engine=args.engine, mode=args.mode, device=args.device, seed=args.seed,
                        timeout=60.0 if args.timeout is None else args.timeout,
                        fault=args.fault, repeat=args.repeat, engine_threads=args.engine_threads, staging_bytes=args.staging_mib << 20,
                        staging_slots=args.staging_slots, scatter_tables=args.scatter_tables, decode_gpu=args.decode_gpu,
                        progress_thread=args.progress_thread == "on",
                        dst_page_size=args.dst_page_size or scenario.dst_page_size,
                        tp=_tp_sizes(args), layer_groups=args.layerwise, layer_split=args.layer_split,
                        forward_dim=args.forward_dim,
                        gather=args.gather, engine_extra=tuple(args.engine_setting), integrity=args.integrity,
                        warm_up=not args.no_warm_up)
    if config.gather:
        ts, td = config.model().src_tp, config.model().dst_tp
        if ts <= td:
            raise Refused("demo", f"--gather needs a larger TP size on the prefill side (here "
                             f"--src-tp {ts} --dst-tp {td})")
        if config.fault != "none" or config.forward:
            raise Refused("demo", "--gather runs without --fault, --layerwise and --forward-dim")
    if config.layer_groups and config.mode == "prepared":
        raise Refused("demo", "--layerwise cannot stream through prepared lists; use --mode auto, "
                         "direct or staged")
    if config.layer_groups > config.layers:
        raise Refused("demo", f"--layerwise {config.layer_groups}: more groups than the "
                         f"{config.layers} layers")
    if config.layer_groups and config.fault != "none":
        raise Refused("demo", "--layerwise runs without a fault drill")
    _check_engine_settings("demo", config.engine, config.engine_extra)
    if config.integrity and (config.mode == "prepared" or config.layer_groups or config.dst_page_size
                             or config.gather):
        raise Refused("demo", "--integrity needs whole destination items and every byte written when planned: not "
                              "with --mode prepared, --layerwise, --dst-page-size or --gather")
    _check_engine("demo", config.engine, config.mode)
    if args.timeout is None:
        config = replace(config, timeout=demo_timeout(config))
    shape = config.model()
    _check_demo(config, shape)
    if args.role != "both":
        return _demo_role(args, config)
    if args.listen or args.peer:
        raise Refused("demo", "--listen and --peer go with --role decode and --role prefill")
    report = run_demo(config, progress=not args.no_progress)
    sys.stdout.write(report.render() + "\n")
    if config.fault != "none":  # a drill passes when exactly its failure was observed
        observed = report.drill_observed()
        sys.stdout.write(f"  drill         {'observed ' + observed if observed else 'NOT the expected failure'}\n")
        return 0 if observed else 1
    return 0 if report.ok else 1


def _demo_role(args: argparse.Namespace, config) -> int:
    """One side of a two-host demo (``--role``): the decode verifies every byte, the prefill reports
    what it sent; each exits 0 when its side succeeded."""
    from .tools.demo import run_role

    address = args.listen if args.role == "decode" else args.peer
    if address is None or (args.listen and args.peer):
        flag = "--listen" if args.role == "decode" else "--peer"
        raise Refused("demo", f"--role {args.role} needs {flag} HOST:PORT (and not the other)")
    if config.gather or config.fault != "none" or config.repeat != 1 or config.forward:
        raise Refused("demo", "--role runs one batch without --gather, --fault, --repeat, --layerwise "
                         "and --forward-dim")
    host, port = address
    config = replace(config, host=host, port=port if args.role == "decode" else 0)
    report = run_role(config, args.role, peer_port=port, progress=not args.no_progress)
    sys.stdout.write(report.render() + "\n")
    return 0 if report.ok else 1


def _json_folder(command: str, path: str | None) -> None:
    """Refuse a ``--json`` file in a folder this process cannot write, before anything runs."""
    if path:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise Refused(command, f"--json {path}: {folder} is not a folder this process can write to")


def _load(args: argparse.Namespace) -> int:
    import json

    from .tools.load import LoadConfig, run_load

    _json_folder("load", args.json)
    layers, token_bytes, page_size = KV_SHAPES[args.preset]
    args.layers, args.page_size = args.layers or layers, args.page_size or page_size
    if args.chunk_tokens % args.page_size:
        raise Refused("load", f"--chunk-tokens {args.chunk_tokens} is not a multiple of the page size {args.page_size}")
    if args.kill_at and args.decodes < 2:
        raise Refused("load", "--kill-at needs at least two decodes (the others' requests must go on)")
    if args.kill_at and not 0 < args.kill_at < args.duration:
        raise Refused("load", f"--kill-at {args.kill_at:g} must fall inside the run's arrivals (0 to --duration "
                              f"{args.duration:g} s): a decode killed outside them kills no request in flight")
    if args.prompt_max < args.page_size:
        raise Refused("load", f"--prompt-max {args.prompt_max} is shorter than a page ({args.page_size} tokens)")
    _check_engine_settings("load", args.engine, args.engine_setting)
    _check_engine("load", args.engine, args.mode)
    if args.prompt_median > args.prompt_max:
        raise Refused("load", f"--prompt-median {args.prompt_median} is above --prompt-max {args.prompt_max}")
    host = args.host
    config = LoadConfig(rate=args.rate, duration=args.duration, decodes=args.decodes, engine=args.engine,
                        mode=args.mode, device=args.device, layers=args.layers, token_bytes=token_bytes,
                        prompt_median=args.prompt_median, prompt_max=args.prompt_max, chunk_tokens=args.chunk_tokens,
                        page_size=args.page_size,
                        prefix_share=args.prefix_share, fault_every=args.fault_every, kill_at=args.kill_at,
                        rows=args.rows, queue=args.queue, timeout=args.timeout, seed=args.seed, host=host,
                        forward_tokens_per_s=args.forward_tokens_per_s, staging_mib=args.staging_mib,
                        engine_extra=tuple(args.engine_setting), integrity=args.integrity,
                        merge_ready=not args.chunk_per_turn, in_flight=args.in_flight, warm_up=not args.no_warm_up)
    if args.metrics_port is not None:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            raise Refused("load", "--metrics-port needs prometheus-client: install kvplan's extra prometheus "
                                  "(pip install '.[prometheus]' in kvplan's checkout)") from None
    if args.find_capacity is not None:
        from .tools.capacity import find_capacity

        if args.metrics_port is not None:
            raise Refused("load", "--find-capacity runs many short loads: not with --metrics-port")
        show = None if args.no_progress else (lambda p: sys.stderr.write(
            f"kvplan load: {p.rate:g}/s {'held' if p.held else 'failed: ' + p.why}\n"))
        found = find_capacity(config, args.find_capacity, steps=args.capacity_steps, progress=show)
        sys.stdout.write("\n".join(found.lines()) + "\n")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(found.as_dict(), f, indent=1)
        return 0 if found.capacity > 0 else 1
    report = run_load(config, progress=not args.no_progress, metrics_port=args.metrics_port)
    sys.stdout.write("\n".join(report.lines()) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.as_dict(), f, indent=1)
    return 0 if report.ok else 1


def _bench(args: argparse.Namespace) -> int:
    import json

    from .tools.bench import progress_printer, render, rows_as_dicts, run_bench

    import torch

    names = args.scenario or list(SCENARIOS)
    _json_folder("bench", args.json)  # refused now, not after the whole bench has run
    scale = args.scale
    if scale is None:  # full size on a GPU; on a CPU the interpreter would take hours
        scale = 1.0 if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else CPU_SCALE
        if scale != 1.0:
            sys.stderr.write(f"kvplan bench: no GPU: scenarios scaled by {scale} (--scale to choose)\n")
    show = None if args.no_progress else progress_printer(len(names))
    rows = run_bench(names, runs=args.runs, scale=scale, staging=args.staging, progress=show)
    if show:
        sys.stderr.write("\n")
    sys.stdout.write(render(rows) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_as_dicts(rows), f, indent=2)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvplan", description="GPU-resident KV-cache transfer planning.")
    parser.add_argument("--version", action="version", version=f"kvplan {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v: INFO lines per batch; -vv: DEBUG")
    verbosity = _Parser(add_help=False)  # so that -v also works after the subcommand
    verbosity.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                           help="-v: INFO lines per batch; -vv: DEBUG lines per section")
    sub = parser.add_subparsers(dest="command", required=True)
    from .tools.demo import FAULTS

    demo = sub.add_parser(
        "demo", parents=[verbosity], help="a real prefill-to-decode hand-off on this machine, verified byte for byte",
        description="Starts a decode and a prefill process on 127.0.0.1 (or runs one side of two hosts: --role) with model-shaped, fragmented paged pools "
                    "(GPU memory when a GPU is present), plans the batch with kvplan, moves it through a real engine "
                    "and checks every byte on the decode side. Exits 1 if any request fails or any byte is wrong.")
    demo.add_argument("--preset", choices=list(SCENARIOS), default="gptoss-swa-p16",
                      help="a scenario of docs/benchmarks.md (the bench's), at small scale (default: %(default)s)")
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
    demo.add_argument("--engine-setting", type=_setting, action="append", default=[], metavar="KEY=VALUE",
                      help="one of the engine's own settings, repeatable: e.g. protocol=nvlink_intra for Mooncake "
                           "between the GPUs of one host (README: engines)")
    demo.add_argument("--integrity", action="store_true",
                      help="per-request checksums of the bytes sent, compared at decode-ready (not with "
                           "--mode prepared, --layerwise or --dst-page-size)")
    demo.add_argument("--no-warm-up", action="store_true",
                      help="skip the endpoints' warm_up() at start-up: the first batch then pays for planner "
                           "captures, kernel loads and the engine's connection (RESULTS: warm start)")
    demo.add_argument("--engine-threads", type=_non_negative, default=0,
                      help="NIXL's UCX worker threads (default: 0, NIXL's own default)")
    demo.add_argument("--staging-mib", type=_positive, default=64,
                      help="staging buffer per side, in MiB, for staged and auto modes (default: 64)")
    demo.add_argument("--progress-thread", choices=("on", "off"), default="on",
                      help="NIXL's own progress thread (default: on); off, kvplan's loops drive the engine")
    demo.add_argument("--decode-gpu", type=int, default=0,
                      help="the decode process's GPU (the prefill's is GPU 0); 1 measures between two cards")
    demo.add_argument("--dst-page-size", type=_positive, default=None,
                      help="the decode side's KV page size, when not the preset's (docs/page_sizes.md)")
    demo.add_argument("--src-tp", type=_positive, default=None,
                      help="the prefill side's attention TP size, when not the preset's (docs/tp_state.md)")
    demo.add_argument("--dst-tp", type=_positive, default=None,
                      help="the decode side's attention TP size, when not the preset's (docs/tp_state.md)")
    demo.add_argument("--gather", action="store_true",
                      help="with --src-tp larger than --dst-tp: one prefill process per source rank of the decode "
                           "rank's group, each sending its part, so every byte of the decode's items is written "
                           "and verified (docs/tp_state.md §4)")
    demo.add_argument("--staging-slots", type=_positive, default=4,
                      help="slots of the sender's staging ring: waves in flight at once (default: 4)")
    demo.add_argument("--scatter-tables", action="store_true",
                      help="staged runs carry every descriptor's destination for the receiver to check, instead "
                           "of letting a receiver that can plan its own scatter do so (for comparison)")
    demo.add_argument("--layerwise", type=_positive, default=0, metavar="GROUPS",
                      help="stream the batch in this many layer groups while a stand-in forward pass writes it "
                           "(docs/layerwise.md)")
    demo.add_argument("--layer-split", choices=["tapered", "even"], default="tapered",
                      help="with --layerwise: groups whose last ones shrink by halves to two layers "
                           "(LayerGroups.tapered), so that little is left to move once the pass ends, or groups of "
                           "equal size (default: tapered)")
    demo.add_argument("--forward-dim", type=int, default=0, metavar="DIM",
                      help="run the stand-in forward pass, each layer a [tokens, DIM] x [DIM, DIM] matmul; without "
                           "--layerwise the batch is sent after it ends (the non-streamed baseline)")
    demo.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                      help="where the pools live; auto picks the GPU when there is one (default: auto)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the allocation and the bytes (default: 0)")
    demo.add_argument("--timeout", type=float, default=None,
                      help="deadline of every wait, in seconds (default: 60; on the CPU, where the kernels run "
                           "interpreted, plus 1 ms per descriptor between TP sizes and, for --mode staged, 4 s per MB "
                           "of KV)")
    demo.add_argument("--fault", choices=FAULTS, default="none",
                      help="drill a failure path: the decode or prefill process dies, the layouts do not pair, or "
                           "nothing is sent before the deadline (default: none)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar on standard error")
    demo.add_argument("--role", choices=("both", "decode", "prefill"), default="both",
                      help="run both sides here (default), or one side, the other being the same command with the "
                           "other role on another machine: decode with --listen, prefill with --peer")
    demo.add_argument("--listen", type=_address, metavar="HOST:PORT",
                      help="with --role decode: the address to bind, which the prefill command names with --peer")
    demo.add_argument("--peer", type=_address, metavar="HOST:PORT",
                      help="with --role prefill: the decode command's --listen address")
    demo.set_defaults(run=_demo)

    bench = sub.add_parser(
        "bench", parents=[verbosity], help="plan latency against the strongest host planners for the scenarios of docs/benchmarks.md",
        description="Plans each scenario with kvplan and with the strongest host planners (numpy-batch, "
                    "prepared-ids, the compact runs form; the SGLang-style loop for reference) in this process, "
                    "checks that every output equals kvplan's, and reports medians, the floor, the ratios against "
                    "the strongest baseline and which targets are met. "
                    "Without a GPU the kernels run in Triton's interpreter: use --scale to keep it short.")
    bench.add_argument("--scenario", action="append", choices=list(SCENARIOS),
                       help="a scenario to run (repeatable; default: all)")
    bench.add_argument("--runs", type=_positive, default=20, help="timed runs per measurement (default: 20)")
    bench.add_argument("--scale", type=_scale, default=None,
                       help=f"shrink requests, tokens and layers by this factor (default: 1 on a GPU, {CPU_SCALE} "
                            "without one)")
    bench.add_argument("--staging", action="store_true",
                       help="also measure the staging gather/scatter against a device-to-device copy (GPU)")
    bench.add_argument("--json", help="write the results as JSON to this file")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar on standard error")
    bench.set_defaults(run=_bench)

    load = sub.add_parser(
        "load", parents=[verbosity], help="serving-shaped load through real endpoints, with faults on a schedule",
        description="One prefill process sends to several decode processes on this machine: Poisson arrivals, "
                    "log-normal prompt lengths, chunked prefill behind a stand-in forward pass, decode-side prefix "
                    "hits, aborts and deadlines on a schedule, optionally a decode killed mid-run. Every completed "
                    "request is checked byte for byte; it reports throughput, latency from the last chunk being "
                    "ready to decode-ready, failures by cause, and each process's memory, descriptors, sockets and "
                    "engine state over time. Exit code 1 when a byte differs, a failure was not injected, or "
                    "something did not drain or grew.")
    load.add_argument("--rate", type=_positive_float, default=20.0, help="arrivals a second (default: 20)")
    load.add_argument("--duration", type=_positive_float, default=5.0, help="seconds of arrivals (default: 5)")
    load.add_argument("--decodes", type=_positive, default=2, help="decode processes (default: 2)")
    load.add_argument("--engine", choices=engine_names(), default="nixl", help="transfer engine (default: nixl)")
    load.add_argument("--engine-setting", type=_setting, action="append", default=[], metavar="KEY=VALUE",
                      help="one of the engine's own settings, repeatable (as for kvplan demo)")
    load.add_argument("--mode", choices=list(MODES), default="auto",
                      help="direct, prepared (NIXL), staged or auto, as for kvplan demo (default: auto)")
    load.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                      help="where the pools live; auto picks the GPU when there is one (default: auto)")
    load.add_argument("--preset", choices=list(KV_SHAPES), default="tiny",
                      help="the KV a token holds: tiny (4 layers of 64-byte K and V entries: the protocol's cost) or "
                           "llama8b (Llama-3.1-8B in bf16: 32 layers, 2 KiB entries, 128 KiB a token); default: tiny")
    load.add_argument("--layers", type=_positive, default=None, help="layers of K and V (default: the preset's)")
    load.add_argument("--page-size", type=_positive, default=None, help="tokens a KV page holds (default: the preset's)")
    load.add_argument("--prompt-median", type=_positive, default=512, help="tokens (log-normal; default: 512)")
    load.add_argument("--prompt-max", type=_positive, default=2048,
                      help="the longest prompt, in tokens; the pools are sized for it (default: 2048)")
    load.add_argument("--chunk-tokens", type=_positive, default=256, help="chunked prefill (default: 256)")
    load.add_argument("--prefix-share", type=_share, default=0.25,
                      help="the share of requests whose decode holds a cached prefix, in [0, 1] (default: 0.25)")
    load.add_argument("--fault-every", type=_non_negative, default=8,
                      help="every n-th request is aborted or given a deadline it cannot meet (0: none)")
    load.add_argument("--kill-at", type=float, default=0.0,
                      help="kill the last decode this many seconds in, inside (0, --duration) (default: 0, none)")
    load.add_argument("--rows", type=_positive, default=32, help="requests a side holds at once (default: 32)")
    load.add_argument("--queue", type=_non_negative, default=0,
                      help="arrivals a decode lets wait for a row; one more is refused as overload at once "
                           "(default: 0, as many as --rows)")
    load.add_argument("--chunk-per-turn", action="store_true",
                      help="send one chunk of a request per batch even when more of it is ready (default: every "
                           "ready chunk of a request as one span)")
    load.add_argument("--no-warm-up", action="store_true",
                      help="skip both sides' warm_up() at start (kernels compile and graphs are captured in the run)")
    load.add_argument("--in-flight", type=_positive, default=2,
                      help="the prefill's batches submitted and not ended at once (default: 2)")
    load.add_argument("--forward-tokens-per-s", type=_positive_float, default=100_000.0,
                      help="the stand-in forward pass's speed (default: 100000)")
    load.add_argument("--staging-mib", type=_positive, default=32,
                      help="staging buffer per side, in MiB, on a GPU for staged and auto modes (default: 32)")
    load.add_argument("--timeout", type=_positive_float, default=30.0, help="each request's deadline (default: 30 s)")
    load.add_argument("--seed", type=_non_negative, default=0, help="seed of the schedule (default: 0)")
    load.add_argument("--host", type=_ip, default="127.0.0.1",
                      help="the address every process binds and advertises (default: 127.0.0.1)")
    load.add_argument("--integrity", action="store_true", help="per-request checksums compared at decode-ready")
    load.add_argument("--metrics-port", type=_non_negative, default=None, metavar="PORT",
                      help="serve the endpoints' counters in Prometheus' text format on --host:PORT while the run "
                           "lasts (needs the prometheus extra; 0: a free port, named on standard error)")
    load.add_argument("--find-capacity", type=_positive_float, default=None, metavar="P99_MS",
                      help="search the highest rate whose run holds: p99 within P99_MS, at least 90%% of its requests completed, "
                           "no overload refusal, every byte equal; doubling from --rate, then bisecting "
                           "(kvplan/tools/capacity.py)")
    load.add_argument("--capacity-steps", type=_positive, default=3,
                      help="with --find-capacity: bisection steps after the doubling (default: 3)")
    load.add_argument("--no-progress", action="store_true", help="no progress line on standard error")
    load.add_argument("--json", help="write the report as JSON to this file")
    load.set_defaults(run=_load)
    return parser


def _check_engine_settings(command: str, engine: str, settings: Any) -> None:
    why = preflight.engine_settings_refusal(engine, settings)
    if why is not None:
        raise Refused(command, why)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    refusal = preflight.environment_refusal()
    if refusal is not None:
        sys.stderr.write(refusal + "\n")
        return 2
    level = preflight.log_level(args.verbose)
    logging.basicConfig(level=level, format="%(levelname)s %(message)s")
    os.environ["KVPLAN_LOG_LEVEL"] = logging.getLevelName(level)  # the demo's processes log alike
    try:
        return args.run(args)
    except Refused as refused:
        sys.stderr.write(f"{refused}\n")
        return 2
    except SideFailed as failed:  # (a side stopped on an error kvplan names: its line, no traceback)
        sys.stderr.write(f"kvplan {args.command}: error: {failed}\n")
        return 1
