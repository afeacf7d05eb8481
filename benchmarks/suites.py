"""The GPU benchmark suites behind benchmarks/RESULTS.md, as data: what each runs, on how many cards,
with which engine wheels (``python -m benchmarks SUITE``, :mod:`benchmarks.__main__`).

A suite is a list of steps; a step is one command (its argv, or a function of the output folder that
makes it), its deadline and its extra environment. Every step runs whatever the previous ones did.

Example::

    for step in SUITES["e2e-nixl"].steps:
        print(step.name, " ".join(step.command("/tmp/out")))
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

__all__ = ["SUITES", "Step", "Suite"]

PY = "python3"
BATCH = ("--preset", "llama70b-tp8-p64", "--layers", "8", "--requests", "8", "--prompt-len", "8192")


@dataclass(frozen=True)
class Step:
    """One command of a suite: ``argv`` (or a function of the output folder that returns it)."""

    name: str
    argv: Sequence[str] | Callable[[str], Sequence[str]]
    timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)

    def command(self, out: str) -> list[str]:
        return list(self.argv(out) if callable(self.argv) else self.argv)


@dataclass(frozen=True)
class Suite:
    """What a suite measures (RESULTS.md quotes it), the wheels it needs carried, its cards, its steps, and an
    archive of packages to unpack onto the path beside the wheels (``site``, carried too)."""

    about: str
    wheels: str
    steps: tuple[Step, ...]
    gpus: int = 1
    site: str = ""


def demo(name: str, *args: str, timeout_s: float = 300.0, env: dict[str, str] | None = None) -> Step:
    return Step(name, (PY, "-m", "kvplan", "demo", "--no-progress", *args), timeout_s, env or {})


def module(name: str, target: str, *args: str, timeout_s: float = 300.0, env: dict[str, str] | None = None) -> Step:
    return Step(name, (PY, "-m", target, *args), timeout_s, env or {})


def pytest(name: str, *args: str, timeout_s: float = 420.0, env: dict[str, str] | None = None) -> Step:
    return Step(name, (PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *args), timeout_s, env or {})


def _load_rate(out: str) -> list[str]:
    """The 10,000-request load run at 80% of the probe's sustained rate (the probe ran just before)."""
    probe = json.load(open(os.path.join(out, "load-nixl-probe.json")))["throughput"]
    rate = max(20, round(0.8 * probe["requests_per_s"] / 0.875))
    return [PY, "-m", "kvplan", "load", "--rate", str(rate), "--duration", str(round(10000 / rate)), "--rows", "64",
            "--json", os.path.join(out, "load-nixl-10k.json")]


def _e2e(engine: str) -> tuple[Step, ...]:
    batch = ("--engine", engine, *BATCH, "--repeat", "12")
    steps = [module("ceiling", "benchmarks.engine_ceiling", engine, "256"),
             demo("direct", "--mode", "direct", *batch)]
    if engine == "nixl":
        steps.append(demo("direct-4-threads", "--mode", "direct", "--engine-threads", "4", *batch))
    steps += [demo("staged-512x1", "--mode", "staged", "--staging-mib", "512", "--staging-slots", "1", *batch),
              demo("staged-256x2", "--mode", "staged", "--staging-mib", "256", "--staging-slots", "2", *batch),
              demo("auto-512x1", "--mode", "auto", "--staging-mib", "512", "--staging-slots", "1", *batch),
              demo("staged-to-p16", "--mode", "staged", "--staging-mib", "512", "--staging-slots", "1",
                   "--dst-page-size", "16", *batch)]
    return tuple(steps)


def _staged() -> tuple[Step, ...]:
    steps = []
    for mib, slots in ((512, 1), (256, 2), (64, 4)):
        staging = ("--mode", "staged", "--staging-mib", str(mib), "--staging-slots", str(slots), "--repeat", "12")
        steps += [demo(f"planned-{mib}x{slots}", "--engine", "nixl", *BATCH, *staging),
                  demo(f"tables-{mib}x{slots}", "--engine", "nixl", *BATCH, *staging, "--scatter-tables"),
                  demo(f"traced-{mib}x{slots}", "--engine", "nixl", *BATCH, *staging, env={"KVPLAN_TRACE": "1"})]
    steps.append(demo("auto-512x1", "--engine", "nixl", *BATCH, "--mode", "auto", "--staging-mib", "512",
                      "--staging-slots", "1", "--repeat", "12"))
    for preset in ("gptoss-swa-p16", "qwen3next-mamba-p64", "dsv32-mla-dsa-p64"):
        steps.append(demo(preset, "--engine", "nixl", "--preset", preset, "--layers", "8", "--requests", "8",
                          "--prompt-len", "4096", "--mode", "staged", "--staging-mib", "256", "--staging-slots", "2",
                          "--repeat", "6"))
    return tuple(steps)


def _tp_state() -> tuple[Step, ...]:
    scenarios = ("qwen3next-mamba-p64", "qwen3next-mamba-tp4to8-p64", "gptoss-swa-p16", "gptoss-swa-tp4to8-p16",
                 "llama70b-tp4to8-p64")
    mamba = ("--preset", "qwen3next-mamba-p64", "--layers", "12", "--requests", "8", "--prompt-len", "4096")
    return (pytest("tests", "tests/planner", "tests/kernels", "tests/transport/test_local.py",
                   "tests/tools/test_baseline.py"),
            Step("bench", lambda out: [PY, "-m", "kvplan", "bench", "--no-progress", "--json",
                                       os.path.join(out, "bench.json"),
                                       *[a for s in scenarios for a in ("--scenario", s)]]),
            demo("mamba-4to8", "--engine", "nixl", *mamba, "--src-tp", "4", "--dst-tp", "8"),
            demo("mamba-4to8-staged", "--engine", "nixl", *mamba, "--src-tp", "4", "--dst-tp", "8", "--mode", "staged"),
            demo("mamba-8to4", "--engine", "nixl", *mamba, "--src-tp", "8", "--dst-tp", "4"),
            demo("gptoss-4to8", "--engine", "nixl", "--preset", "gptoss-swa-p16", "--src-tp", "4", "--dst-tp", "8"),
            demo("dsv32-4to8", "--engine", "nixl", "--preset", "dsv32-mla-dsa-p64", "--src-tp", "4", "--dst-tp", "8"))


def _warm_start() -> tuple[Step, ...]:
    common = ("--engine", "nixl", "--layers", "8", "--requests", "8", "--prompt-len", "8192", "--repeat", "8",
              "--staging-mib", "256", "--staging-slots", "2")
    steps = [pytest("tests", "tests/planner/device/test_graphs.py", "tests/planner/device/test_planner.py",
                    "tests/transport/test_copy_graphs.py", "tests/transport/test_local.py", "tests/kernels"),
             demo("empty-cache", *common, "--preset", "llama70b-tp8-p64", "--mode", "auto",
                  env={"TRITON_CACHE_DIR": "/tmp/kvplan-empty-triton-cache"})]
    for preset in ("llama70b-tp8-p64", "llama70b-tp4to8-p64"):
        steps += [demo(f"fill-cache-{preset}", *common, "--preset", preset, "--mode", "auto"),
                  demo(f"fill-cache-{preset}-cold", *common, "--preset", preset, "--mode", "auto", "--no-warm-up")]
    for preset in ("llama70b-tp8-p64", "llama70b-tp4to8-p64"):
        for mode in ("staged", "auto", "direct"):
            if preset == "llama70b-tp4to8-p64" and mode == "direct":
                continue  # (a million descriptors direct: minutes)
            steps += [demo(f"{preset}-{mode}", *common, "--preset", preset, "--mode", mode),
                      demo(f"{preset}-{mode}-cold", *common, "--preset", preset, "--mode", mode, "--no-warm-up")]
    for mode in ("staged", "direct"):
        for fault in ("dead-decode", "dead-prefill", "dead-decode-mid", "dead-prefill-mid", "bad-registration",
                      "deadline"):
            steps.append(demo(f"drill-{mode}-{fault}", "--engine", "nixl", "--preset", "llama70b-tp8-p64", "--layers",
                              "4", "--requests", "4", "--prompt-len", "4096", "--mode", mode, "--fault", fault,
                              timeout_s=120))
    return tuple(steps)


def _layerwise(extra: Sequence[str] = (), tests: bool = True) -> tuple[Step, ...]:
    steps = [pytest("tests", "tests/planner/contract/test_layer_groups.py", "tests/transport/test_handoff.py", "-k", "layer",
                    env={"KVPLAN_TEST_ENGINES": "nixl"}),
             pytest("event-test", "tests/transport/test_layerwise.py::"
                    "test_a_groups_event_is_offered_only_once_this_pass_has_queued_its_mark", timeout_s=60)] if tests else []
    steps.append(Step("layerwise", lambda out: [PY, "benchmarks/layerwise.py", "--out", out, "--engine", "nixl",
                                                *extra], 420))
    if tests:
        one = ("--engine", "nixl", "--requests", "1", "--prompt-len", "8192", "--chunks", "1", "--timeout", "30",
               "--mode", "staged")
        trace = {"KVPLAN_TRACE": "1"}
        steps += [demo("trace-llama70b", *one, "--preset", "llama70b-tp8-p64", "--layers", "80", "--forward-dim",
                       "10240", "--layerwise", "8", env=trace, timeout_s=100),
                  demo("trace-gptoss", *one, "--preset", "gptoss-swa-p16", "--layers", "18", env=trace, timeout_s=100),
                  demo("trace-gptoss-tables", *one, "--preset", "gptoss-swa-p16", "--layers", "18", "--scatter-tables",
                       env=trace, timeout_s=100)]
    return tuple(steps)


def _two_cards() -> tuple[Step, ...]:
    batch = ("--engine", "nixl", "--decode-gpu", "1", *BATCH, "--repeat", "12")
    return (Step("topology", ("nvidia-smi", "topo", "-m"), 30),
            module("ceiling", "benchmarks.engine_ceiling", "nixl", "256", "1"),
            demo("staged-512x1", *batch, "--mode", "staged", "--staging-mib", "512", "--staging-slots", "1"),
            demo("staged-256x4", *batch, "--mode", "staged", "--staging-mib", "256", "--staging-slots", "4"),
            demo("auto-512x2", *batch, "--mode", "auto", "--staging-mib", "512", "--staging-slots", "2"),
            demo("direct", *batch, "--mode", "direct"),
            *_layerwise(("--skip-signal", "--decode-gpu", "1", "--staging", "256:2", "--staging", "512:1", "--modes",
                         "staged", "--largest-only", "--repeat", "8"), tests=False))


def _last_group() -> tuple[Step, ...]:
    steps = [module("post-cost-across", "benchmarks.post_cost", "1", timeout_s=120),
             module("post-cost-within", "benchmarks.post_cost", "0", timeout_s=120),
             module("graph-launch", "benchmarks.graph_launch", timeout_s=120)]
    for staging in ("256:2", "512:1"):
        mib, slots = staging.split(":")
        for split in ("even", "tapered"):
            steps.append(demo(f"trace-{mib}x{slots}-{split}", "--engine", "nixl", "--preset", "llama70b-tp8-p64",
                              "--layers", "80", "--forward-dim", "10240", "--layerwise", "8", "--layer-split", split,
                              "--mode", "staged", "--decode-gpu", "1", "--staging-mib", mib, "--staging-slots", slots,
                              "--requests", "1", "--prompt-len", "8192", "--chunks", "1", "--repeat", "4", "--timeout",
                              "30", env={"KVPLAN_TRACE": "1"}, timeout_s=100))
    steps += _layerwise(("--skip-signal", "--decode-gpu", "1", "--staging", "256:2", "--staging", "512:1", "--modes",
                         "staged", "--largest-only", "--repeat", "6", "--split", "even", "--split", "tapered"),
                        tests=False)
    return tuple(steps)


def _gather() -> tuple[Step, ...]:
    common = ("--engine", "nixl", "--requests", "8", "--prompt-len", "4096", "--src-tp", "8", "--dst-tp", "4",
              "--gather", "--decode-gpu", "1", "--repeat", "4", "--timeout", "60")
    mamba = ("--preset", "qwen3next-mamba-p64", "--layers", "12")
    return (demo("mamba-auto", *common, *mamba, "--mode", "auto", timeout_s=120),
            demo("mamba-staged", *common, *mamba, "--mode", "staged", timeout_s=120),
            demo("mamba-direct", *common, *mamba, "--mode", "direct", timeout_s=120),
            demo("llama70b-staged", *common, "--preset", "llama70b-tp8-p64", "--layers", "8", "--mode", "staged",
                 timeout_s=120))


def _mooncake_nvlink() -> tuple[Step, ...]:
    to = lambda: "1" if _gpus() > 1 else "0"  # noqa: E731 - between two cards where there are two
    steps = [module("peer-copy", "benchmarks.peer_copy", "256", timeout_s=120)]
    for pieces in ("1", "64", "6832"):
        steps.append(Step(f"ceiling-{pieces}", lambda out, p=pieces: [PY, "-m", "benchmarks.engine_ceiling", "mooncake",
                                                                       "256", to(), p, "protocol=nvlink_intra"], 120))
    for name, staging in (("staged-512x1", ("--mode", "staged", "--staging-mib", "512", "--staging-slots", "1")),
                          ("staged-256x4", ("--mode", "staged", "--staging-mib", "256", "--staging-slots", "4")),
                          ("auto-512x2", ("--mode", "auto", "--staging-mib", "512", "--staging-slots", "2")),
                          ("direct", ("--mode", "direct"))):
        steps.append(Step(name, lambda out, s=staging: [PY, "-m", "kvplan", "demo", "--no-progress", "--engine",
                                                         "mooncake", "--engine-setting", "protocol=nvlink_intra",
                                                         "--decode-gpu", to(), *s, *BATCH, "--repeat", "12"], 200))
    steps.append(Step("load", lambda out: [PY, "-m", "kvplan", "load", "--engine", "mooncake", "--engine-setting",
                                           "protocol=nvlink_intra", "--rate", "200", "--duration", "10", "--rows", "64",
                                           "--json", os.path.join(out, "load-mooncake-nvlink.json")], 150))
    return tuple(steps)


def _engines_two_cards() -> tuple[Step, ...]:
    """Issue 37's table in one run: the peer copy, both engines' ceilings and kvplan through each, GPU 0 -> 1."""
    nixl = ("--engine", "nixl", "--decode-gpu", "1", *BATCH)
    mooncake = ("--engine", "mooncake", "--engine-setting", "protocol=nvlink_intra", "--decode-gpu", "1", *BATCH)
    staging = {"staged-512x1": ("--mode", "staged", "--staging-mib", "512", "--staging-slots", "1"),
               "staged-256x4": ("--mode", "staged", "--staging-mib", "256", "--staging-slots", "4"),
               "auto-512x2": ("--mode", "auto", "--staging-mib", "512", "--staging-slots", "2"),
               "direct": ("--mode", "direct")}
    steps = [Step("topology", ("nvidia-smi", "topo", "-m"), 30),
             module("peer-copy", "benchmarks.peer_copy", "256", timeout_s=60),
             module("nixl-ceiling", "benchmarks.engine_ceiling", "nixl", "256", "1", timeout_s=90)]
    steps += [module(f"mooncake-ceiling-{pieces}", "benchmarks.engine_ceiling", "mooncake", "256", "1", pieces,
                     "protocol=nvlink_intra", timeout_s=90) for pieces in ("1", "64", "6832")]
    engines = (("nixl", nixl), ("mooncake", mooncake))
    steps += [demo(f"{engine}-{name}", *batch, *args, "--repeat", "12", timeout_s=150)
              for engine, batch in engines for name, args in staging.items()]
    steps += [demo(f"{engine}-staged-512x1-cold", *batch, *staging["staged-512x1"], "--repeat", "6", "--no-warm-up",
                   timeout_s=150) for engine, batch in engines]
    steps += [demo(f"{engine}-staged-512x1-traced", *batch, *staging["staged-512x1"], "--repeat", "4",
                   env={"KVPLAN_TRACE": "1"}, timeout_s=150) for engine, batch in engines]
    return tuple(steps)


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _vllm() -> tuple[Step, ...]:
    return (Step("plan-16x5k", lambda out: [PY, "-m", "benchmarks.vllm_shapes", "--batches", "16x5k", "--out", out],
                 580),
            Step("move-4x32k", lambda out: [PY, "-m", "benchmarks.vllm_shapes", "--batches", "4x32k", "--no-plan",
                                            "--out", out], 580),
            Step("move-cold", lambda out: [PY, "-m", "benchmarks.vllm_shapes", "--batches", "16x5k", "--no-plan",
                                           "--modes", "staged", "direct", "--warm-up", "off", "--out", out], 400),
            Step("move-tp4to8", lambda out: [PY, "-m", "benchmarks.vllm_shapes", "--batches", "16x5k", "4x32k",
                                             "--no-plan", "--tp", "4", "8", "--modes", "staged",
                                             "--placements", "fragmented", "--out", out], 500),
            Step("move-tp8to4", lambda out: [PY, "-m", "benchmarks.vllm_shapes", "--batches", "16x5k", "4x32k",
                                             "--no-plan", "--tp", "8", "4", "--modes", "staged",
                                             "--placements", "fragmented", "--out", out], 500))


def _ipc() -> tuple[Step, ...]:
    """Issue 55 on one card: the ipc engine's tests compiled, its one launch against a device copy, the
    engines' one-write ceilings, kvplan's batches through ipc next to NIXL's in the same run."""
    ipc = ("--engine", "ipc", "--mode", "direct")
    steps = [pytest("tests", "tests/kernels/test_translate.py", "tests/transport/test_ipc_gpu.py",
                    "tests/transport/test_ipc_engine.py", timeout_s=300),
             module("ipc-copy", "benchmarks.ipc_copy", timeout_s=300),
             module("ceiling-nixl", "benchmarks.engine_ceiling", "nixl", "256"),
             module("ceiling-nixl-6832", "benchmarks.engine_ceiling", "nixl", "256", "0", "6832"),
             module("ceiling-ipc", "benchmarks.engine_ceiling", "ipc", "256"),
             demo("llama70b-ipc", *ipc, *BATCH, "--repeat", "12", timeout_s=150),
             demo("llama70b-ipc-auto", "--engine", "ipc", *BATCH, "--repeat", "12", timeout_s=150),
             demo("llama70b-nixl-direct", "--engine", "nixl", "--mode", "direct", *BATCH, "--repeat", "12", timeout_s=150),
             demo("llama70b-nixl-staged", "--engine", "nixl", "--mode", "staged", "--staging-mib", "512",
                  "--staging-slots", "1", *BATCH, "--repeat", "12", timeout_s=150),
             demo("llama70b-ipc-to-p16", *ipc, *BATCH, "--dst-page-size", "16", "--repeat", "6", timeout_s=150),
             demo("tp4to8-ipc", *ipc, "--preset", "llama70b-tp4to8-p64", "--layers", "8", "--requests", "4",
                  "--prompt-len", "4096", "--repeat", "4", timeout_s=200),
             ]
    return tuple(steps)


def _ipc_ahead() -> tuple[Step, ...]:
    """The first call after a direct send's launch was queued behind its plan."""
    ipc = ("--engine", "ipc", "--mode", "direct")
    return (pytest("tests", "tests/kernels/test_translate.py", "tests/transport/test_ipc_gpu.py",
                   "tests/transport/test_ipc_engine.py", timeout_s=240),
            pytest("compile", "tests/kernels/test_compile.py", "-k", "translate or copy", timeout_s=120),
            demo("llama70b-ipc", *ipc, *BATCH, "--repeat", "12", timeout_s=120),
            demo("llama70b-nixl-staged", "--engine", "nixl", "--mode", "staged", "--staging-mib", "512",
                 "--staging-slots", "1", *BATCH, "--repeat", "12", timeout_s=120),
            demo("llama70b-ipc-to-p16", *ipc, *BATCH, "--dst-page-size", "16", "--repeat", "6", timeout_s=100),
            demo("tp4to8-ipc", *ipc, "--preset", "llama70b-tp4to8-p64", "--layers", "8", "--requests", "4",
                 "--prompt-len", "4096", "--repeat", "4", timeout_s=120),
            demo("layerwise-ipc", *ipc, *BATCH, "--layerwise", "4", "--forward-dim", "4096", "--repeat", "6",
                 timeout_s=120))


def _ipc_streams() -> tuple[Step, ...]:
    """The second: streaming's exposed time, the vLLM-shaped batch, two drills."""
    ipc = ("--engine", "ipc", "--mode", "direct")
    vllm = ("--batches", "16x5k", "--no-plan", "--placements", "fragmented", "--repeats", "4")
    return (pytest("event-test", "tests/transport/test_layerwise.py::"
                   "test_a_groups_event_is_offered_only_once_this_pass_has_queued_its_mark", timeout_s=60),
            Step("layerwise", lambda out: [PY, "benchmarks/layerwise.py", "--out", out, "--engine", "ipc", "--modes",
                                           "direct", "--largest-only", "--repeat", "4"], 240),
            *_vllm_16x5k(vllm),
            demo("drill-dead-decode-mid", *ipc, "--fault", "dead-decode-mid", timeout_s=60),
            demo("drill-deadline", *ipc, "--fault", "deadline", timeout_s=60))


def _vllm_16x5k(vllm: Sequence[str]) -> tuple[Step, ...]:
    """The vLLM-shaped batch through the connector: ipc direct, then NIXL staged (each shape's processes
    limited to 100 s, inside the step's deadline, so that a stuck run says why)."""
    limit = ("--limit-s", "100")
    return (Step("vllm-16x5k-ipc", lambda out: [PY, "-m", "benchmarks.vllm_shapes", *vllm, *limit, "--engine", "ipc",
                                                "--modes", "direct", "--out", out], 150),
            Step("vllm-16x5k-nixl", lambda out: [PY, "-m", "benchmarks.vllm_shapes", *vllm, *limit, "--modes",
                                                 "staged", "--out", out], 150))


def _sglang_backends() -> tuple[Step, ...]:
    # a Llama-3.1-8B-shaped KV (32 layers, 8 KV heads of 128) in SGLang's pools on the card; Mooncake over TCP
    # (SGLang's default transport is RDMA, which two processes on one card do not need)
    shape = ("--device", "cuda", "--layers", "32", "--heads", "8", "--head-dim", "128")
    # SGLang's radix tree in its Python core: the Rust core reads tensors through tvm-ffi's DLPack, which under
    # the cards' torch 2.11 took the decode's int64 page indices for ComplexHalf and stopped every decode (both
    # backends alike; an H100, session 44). Both backends share the tree, so the comparison keeps its terms
    env = {"MOONCAKE_PROTOCOL": "tcp", "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}
    # first the aux mirror's CUDA path on its own (SGLang's aux rows in host memory beside device pools); the
    # warm-up then compiles every Triton kernel both adapters use (kvplan's planner and copies, SGLang's
    # allocator) into the cache the last step's processes share: no run pays for compiling
    return (pytest("aux-mirror", "tests/integrations/test_sglang_aux_mirror.py", "-k", "gpu", timeout_s=60),
            Step("warm-up", lambda out: [PY, "-m", "benchmarks.sglang_backends", *shape, "--waves", "1", "--runs",
                                         "kvplan-nixl,kvplan-ipc,sglang-nixl", "--deadline-s", "60"], 170, env),
            Step("sglang-backends", lambda out: [PY, "-m", "benchmarks.sglang_backends", *shape, "--waves", "4",
                                                 "--deadline-s", "60", "--json",
                                                 os.path.join(out, "sglang-backends.json")], 330, env))


def _served() -> tuple[Step, ...]:
    """``kvplan load`` as a served request meets it (every request byte-checked), one step per row: the
    baseline a faster runtime is measured against in the same call."""
    common = ("--fault-every", "0", "--forward-tokens-per-s", "1e12", "--timeout", "5", "--duration", "4",
              "--no-progress")

    def row(name: str, *args: str) -> Step:
        return Step(name, lambda out: [PY, "-m", "kvplan", "load", *common, *args, "--json",
                                       os.path.join(out, f"served-{name}.json")], 120)

    return (row("tiny-400-nixl", "--rate", "400", "--rows", "64"),
            row("tiny-1000-nixl", "--rate", "1000", "--rows", "64"),
            row("tiny-1000-ipc", "--rate", "1000", "--rows", "64", "--engine", "ipc"),
            row("llama8b-200-nixl", "--preset", "llama8b", "--rate", "200", "--rows", "32", "--prompt-max", "2048"))


def _vllm_backends() -> tuple[Step, ...]:
    # the CPU run's requests (results/2026-12-05-cpu-session44-vllm-backends/) with the KV on the card. The
    # warm-up compiles kvplan's kernels (planner, copies; 44-109 s on a fresh card in session 38) into the cache
    # the later processes share; vLLM's connector compiles nothing. The steps fit one call (250 + 320 s)
    card = ("--device", "cuda")
    return (Step("warm-up", lambda out: [PY, "-m", "benchmarks.vllm_backends", *card, "--requests", "4", "--repeats",
                                         "1", "--runs", "kvplan-nixl,kvplan-mooncake", "--deadline-s", "150"], 250),
            Step("vllm-backends", lambda out: [PY, "-m", "benchmarks.vllm_backends", *card, "--repeats", "3",
                                               "--deadline-s", "60", "--json", os.path.join(out, "vllm-backends.json")],
                 320))


def _ipc_drills() -> tuple[Step, ...]:
    """Issue 55's second call: layer-wise streaming, every preset and the fault drills through ipc."""
    ipc = ("--engine", "ipc", "--mode", "direct")
    steps = [module("ceiling-ipc", "benchmarks.engine_ceiling", "ipc", "256"),
             demo("layerwise-ipc", *ipc, *BATCH, "--layerwise", "4", "--forward-dim", "4096", "--repeat", "6",
                  timeout_s=200),
             demo("layerwise-nixl-staged", "--engine", "nixl", "--mode", "staged", *BATCH, "--layerwise", "4",
                  "--forward-dim", "4096", "--repeat", "6", timeout_s=200)]
    for preset in ("gptoss-swa-p16", "qwen3next-mamba-p64", "dsv32-mla-dsa-p64"):
        steps.append(demo(f"{preset}-ipc", *ipc, "--preset", preset, "--layers", "8", "--requests", "8",
                          "--prompt-len", "4096", "--repeat", "3", timeout_s=150))
    for fault in ("dead-decode", "dead-prefill", "dead-decode-mid", "dead-prefill-mid", "bad-registration", "deadline"):
        steps.append(demo(f"drill-{fault}", *ipc, "--fault", fault, timeout_s=120))
    return tuple(steps)


SUITES: dict[str, Suite] = {
    "gpu-tests": Suite("the kernel, planner and transport tests, kernels compiled for the card", ".whl", (
        pytest("planner-kernels", "tests/planner", "tests/compat", "tests/kernels", "tests/tools/test_baseline.py"),
        pytest("transport", "tests/transport/test_copy_graphs.py", "tests/transport/test_local.py",
               "tests/planner/device/test_planner.py", "tests/planner/device/test_no_sync.py", "tests/transport/test_handoff.py",
               "-k", "not mooncake and (staged or Copy or copy or local or device or sync or ahead)"))),
    "transport-nixl": Suite("every transport test through NIXL with GPU pools", ".whl", (
        pytest("transport", "tests/transport", env={"KVPLAN_TEST_ENGINES": "nixl"}, timeout_s=900),)),
    "transport-mooncake": Suite("every transport test through Mooncake with GPU pools", ".whl-mc", (
        pytest("transport", "tests/transport", env={"KVPLAN_TEST_ENGINES": "mooncake"}, timeout_s=900),)),
    "plan": Suite("planning against the strongest host planners (issue 10), publication, pytest-benchmark gates",
                  ".whl", (
        Step("bench", lambda out: [PY, "-m", "kvplan", "bench", "--staging", "--no-progress", "--json",
                                   os.path.join(out, "bench.json")], 420),
        module("host-steps", "benchmarks.plan_host_steps", timeout_s=90),
        Step("publish-latency", lambda out: [PY, "-m", "benchmarks.publish_latency", "--json",
                                             os.path.join(out, "publish_latency.json")], 300),
        pytest("gates", "benchmarks", "--benchmark-columns=median,ops", "--benchmark-sort=name",
               env={"KVPLAN_BENCH_SCALE": "1", "KVPLAN_BENCH_GATES": "1"}))),
    "e2e-nixl": Suite("the issue-11 batch through NIXL on one card: the engine's ceiling, direct, staged, auto",
                      ".whl", _e2e("nixl")),
    "e2e-mooncake": Suite("the same through Mooncake (TCP)", ".whl-mc", _e2e("mooncake")),
    "demo": Suite("kvplan demo over every preset through NIXL", ".whl", tuple(
        demo(name, "--engine", "nixl", *args) for name, args in (
            ("default", ()), ("staged", ("--mode", "staged")), ("prepared", ("--mode", "prepared")),
            ("llama70b", BATCH), ("llama70b-staged", (*BATCH, "--mode", "staged")),
            ("tp4to8-staged", ("--preset", "llama70b-tp4to8-p64", "--layers", "8", "--requests", "4", "--prompt-len",
                               "4096", "--mode", "staged")),
            ("dsv32", ("--preset", "dsv32-mla-dsa-p64", "--layers", "8", "--requests", "8", "--prompt-len", "4096")),
            ("mamba", ("--preset", "qwen3next-mamba-p64", "--layers", "12", "--requests", "8", "--prompt-len",
                       "4096"))))),
    "staged": Suite("staged mode: the receiver-planned scatter against destination tables, traced, every preset",
                    ".whl", _staged()),
    "tp-state": Suite("state between TP sizes (issue 16): tests, bench rows, demos 4 <-> 8", ".whl", _tp_state()),
    "layerwise": Suite("streaming in layer groups on one card (issue 15)", ".whl", _layerwise()),
    "load": Suite("kvplan load: a profiled probe, a decode killed mid-run, 10,000 requests", ".whl", (
        Step("probe", lambda out: [PY, "-m", "kvplan", "load", "--rate", "400", "--duration", "5", "--rows", "64",
                                   "--json", os.path.join(out, "load-nixl-probe.json")], 100),
        Step("kill", lambda out: [PY, "-m", "kvplan", "load", "--rate", "100", "--duration", "10", "--decodes", "3",
                                  "--kill-at", "5", "--json", os.path.join(out, "load-nixl-kill.json")], 100),
        Step("10k", _load_rate, 400))),
    "served": Suite("a served request's phases, CPU per process and caller time: kvplan load at 400 and 1,000 "
                    "offered/s with 64-byte tokens (NIXL, ipc), and with Llama-3.1-8B's 128 KiB tokens",
                    ".whl-both", _served()),
    "integrity": Suite("per-request checksums: the kernel, its speed, demos with and without, a load run", ".whl", (
        pytest("tests", "tests/kernels/test_checksum.py"),
        module("bandwidth", "benchmarks.checksum_bandwidth"),
        *(demo(f"{name}{'-integrity' if flag else ''}", *mode, *flag, *BATCH, "--repeat", "12", timeout_s=120)
          for name, mode in (("staged", ("--mode", "staged", "--staging-mib", "512", "--staging-slots", "1")),
                             ("direct", ("--mode", "direct")))
          for flag in ((), ("--integrity",))),
        Step("load", lambda out: [PY, "-m", "kvplan", "load", "--rate", "50", "--duration", "20", "--integrity",
                                  "--json", os.path.join(out, "load-integrity.json")], 120))),
    "warm-start": Suite("issue 37's warm start: first batch against steady, with and without warm_up(); fault drills",
                        ".whl", _warm_start()),
    "vllm": Suite("vLLM-shaped batches through the vLLM connector (issue 39)", ".whl", _vllm()),
    "mooncake-nvlink": Suite("Mooncake's NVLink transport with the physical ceiling in the same run", ".whl-mc",
                             _mooncake_nvlink()),
    "ipc": Suite("issue 55: the same-host ipc engine on one card, against a device copy and NIXL in the same run "
                 "(python -m benchmarks.trim_wheels makes .whl-both)", ".whl-both", _ipc()),
    "ipc-ahead": Suite("issue 55, launches behind the plan: the ipc tests compiled (the counted translation, the "
                       "streamed launches), kvplan's batches through ipc and NIXL staged in the same run",
                       ".whl-both", _ipc_ahead()),
    "ipc-streams": Suite("issue 55, launches behind the marks: layer-wise streaming through ipc, the vLLM-shaped "
                         "batch through the connector over ipc against NIXL, two drills", ".whl-both", _ipc_streams()),
    "ipc-vllm": Suite("issue 55: the vLLM-shaped 16 x 5,120 batch through kvplan's connector over ipc and over NIXL "
                      "staged", ".whl-both", _vllm_16x5k(("--batches", "16x5k", "--no-plan", "--placements",
                                                          "fragmented", "--repeats", "4"))),
    "ipc-drills": Suite("issue 55: layer-wise streaming, every preset and the fault drills through the ipc engine",
                        ".whl-both", _ipc_drills()),
    "engines-two-cards": Suite("issue 37's table in one run: the peer copy, NIXL's and Mooncake nvlink_intra's "
                               "ceilings, kvplan through each, first batch against steady (python -m "
                               "benchmarks.trim_wheels makes .whl-both)", ".whl-both", _engines_two_cards(), 2),
    "sglang-backends": Suite("kvplan inside SGLang 0.5.23's own scheduler queues against SGLang's own Mooncake and "
                             "NIXL backends, pools on the card (python -m benchmarks.sglang_site makes .whl-sglang)",
                             ".whl-both", _sglang_backends(), site=".whl-sglang/sglang-site.tar.xz"),
    "vllm-backends": Suite("kvplan's vLLM connector against vLLM 0.33.0's own NixlConnector, the KV on the card "
                           "(python -m benchmarks.vllm_site makes .whl-vllm)", ".whl-both", _vllm_backends(),
                           site=".whl-vllm/vllm-site.tar.xz"),
    "two-cards": Suite("NIXL between two cards: the ceiling, demos, layer-wise streaming", ".whl", _two_cards(), 2),
    "last-group": Suite("where a streamed last layer group's time goes, on two cards", ".whl", _last_group(), 2),
    "gather": Suite("TP gather: one prefill process per source rank, the decode on the second card", ".whl",
                    _gather(), 2),
}
