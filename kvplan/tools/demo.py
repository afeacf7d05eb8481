"""``kvplan demo``: a real prefill-to-decode hand-off on one machine, verified byte for byte.

Two processes on 127.0.0.1. The decode process backs a model-shaped paged pool (GPU memory when
a GPU is present) with fragmented allocation, pre-allocates pages and state for a batch of
requests and publishes them; the prefill process fills its pool with known bytes, plans the
batch with kvplan (chunked, with state components) and moves it through NIXL or Mooncake,
directly, through prepared lists or staged. The decode process checks every byte it received
against a reference execution of the same plan on its own copy of the source bytes.

``fault`` drills the failure paths: ``dead-decode`` (the receiver dies before the send),
``dead-decode-mid`` (it dies once its first request has completed), ``dead-prefill-mid`` (the
sender dies after the first chunks of every request have been sent),
``dead-prefill`` (the sender dies after pairing), ``bad-registration`` (the receiver's layout
does not pair), ``deadline`` (nothing is ever sent).

``layer_groups`` streams the batch behind a stand-in forward pass (:mod:`.forward`) in that many
layer groups (``layer_split``: tapered to a last group of two layers, or even); ``forward_dim``
sizes its per-layer matmul. With ``forward_dim`` alone the batch is sent once the pass has ended:
the non-streamed baseline. Either way the report says how long the pass took and how long after
its end the decode side had every request (the exposed transfer).

Example::

    report = run_demo(DemoConfig(preset="gptoss-swa-p16", engine="nixl"))
    print(report.render()); sys.exit(0 if report.ok else 1)
"""

from __future__ import annotations

import ipaddress
import logging
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import env
from .baseline import sglang_style_descs
from .bench import median_ms
from ..planner.device import eager
from ..planner.device.destinations import PreallocatedRequest
from ..planner.contract.layer_groups import LayerGroups
from ..planner.contract.batch import Attention, Batch, SideMemory
from ..planner.contract.state_kinds import rules_of
from ..planner.contract.pairing import Mode, pair_sides
from ..planner.reference.oracle import plan_reference
from ..planner.contract.tensor_slices import partner_rank
from .scenarios import PRESETS, ModelShape, build_batch, materialize, paired_ranks
from ..profiling import Profile
from ..transport.control import ControlChannel
from ..transport.endpoints import Chunk, DecodeEndpoint, PrefillEndpoint
from ..transport.engines import make_engine
from .forward import StandInForward
from .target_process import child_message, child_pipe, start_child
from .verify import AddressSpace, execute

__all__ = ["DemoConfig", "DemoReport", "FAULTS", "run_demo"]

log = logging.getLogger(__name__)

FAULTS = ("none", "dead-decode", "dead-prefill", "dead-decode-mid", "dead-prefill-mid", "bad-registration", "deadline")
# (Mooncake's TCP settings: the engine sets them, kvplan.transport.engines.mooncake.TCP_DEFAULTS)
ENGINE_ENV = (("UCX_NET_DEVICES", "lo"), ("NIXL_LOG_LEVEL", "WARN"), ("GLOG_minloglevel", "2"))
DEMO_HOST = "127.0.0.1"  # the demo's two processes meet on loopback: its choice, not the library's
STAGES = ("start decode", "start prefill", "pair", "publish lists", "plan", "transfer", "complete", "verify")


@dataclass(frozen=True)
class DemoConfig:
    """Everything a demo run depends on; both processes rebuild the same scenario from it."""

    preset: str = "gptoss-swa-p16"
    layers: int = 4
    requests: int = 8
    prompt_len: int | tuple[int, ...] = 2048
    chunks: int = 2
    prefix_len: int = 0
    mean_run: float | None = None
    engine: str = "nixl"
    mode: str = "auto"
    device: str = "auto"
    seed: int = 0
    timeout: float = 60.0
    fault: str = "none"
    shape: ModelShape | None = None  # overrides preset/layers/mean_run (tests use small custom shapes)
    staging_bytes: int = 64 << 20
    staging_slots: int = 4  # the staging ring's length on the sending side
    scatter_tables: bool = False  # staged runs always carry destination tables (no receiver-planned scatter)
    progress_thread: bool = True  # NIXL's own (spinning) progress thread
    decode_gpu: int = 0  # the decode process's GPU (the prefill's is GPU 0): 1 moves bytes between two cards
    engine_threads: int = 0  # NIXL's UCX worker threads (0: NIXL's default)
    repeat: int = 1  # batches sent one after another (new request ids each time); timing: first and steady
    dst_page_size: int | None = None  # the decode side's KV page size, when not the preset's (docs/page_sizes.md)
    tp: tuple[int, int] | None = None  # (source, destination) attention TP sizes, when not the preset's
    layer_groups: int = 0  # stream behind a stand-in forward pass in this many layer groups (0: no streaming)
    layer_split: str = "tapered"  # how the layers are split into groups: LayerGroups.tapered or LayerGroups.even
    forward_dim: int = 0  # the stand-in forward pass's per-layer matmul: [tokens, dim] x [dim, dim]
    gather: bool = False  # TP gather (source TP > destination TP): a prefill process per source rank of the group
    host: str = DEMO_HOST  # the address the two sides bind and advertise (the decode listens there)
    port: int = 0  # the decode's control port (0: an ephemeral one, told to the prefill by the parent)
    engine_extra: tuple[tuple[str, Any], ...] = ()  # the engine's own settings (--engine-setting KEY=VALUE)
    integrity: bool = False  # per-request checksums compared at decode-ready (kvplan.transport.integrity)
    warm_up: bool = True  # both endpoints' warm_up() before the first batch (a warm start)

    @property
    def forward(self) -> bool:
        """Whether a stand-in forward pass writes the pool before (or while) it is sent."""
        return bool(self.layer_groups or self.forward_dim)

    def engine_settings(self, gpu: int = 0) -> dict[str, Any]:
        """The engine's settings for the process on GPU ``gpu``: the demo's own, then ``extra``'s."""
        settings = {"num_threads": self.engine_threads} if self.engine_threads and self.engine == "nixl" else {}
        if gpu:
            settings["device_id"] = gpu
        if not self.progress_thread and self.engine == "nixl":
            settings["progress_thread"] = False
        if self.engine == "mooncake":  # the demo's own choice of address (NIXL: UCX picks the device, ENGINE_ENV)
            settings["local_hostname"] = self.host
        return {**settings, **dict(self.engine_extra)}

    def warm_bound(self) -> tuple[int, int]:
        """What the endpoints' warm-up prepares for: this demo's batch (transfers, longest prompt)."""
        lens = self.prompt_len if isinstance(self.prompt_len, tuple) else (self.prompt_len,)
        return self.requests * max(1, self.chunks), max(1, *lens)

    def round_ids(self, k: int) -> str:
        return "" if self.repeat == 1 else f"#{k}"

    def groups(self) -> LayerGroups:
        """The stand-in forward pass's layer groups (one group when the batch is not streamed)."""
        split = {"even": LayerGroups.even, "tapered": LayerGroups.tapered}[self.layer_split]
        return split(self.model().layers, max(1, self.layer_groups))

    def model(self) -> ModelShape:
        if self.shape is not None:
            return self.shape
        shape = PRESETS[self.preset].scaled(layers=self.layers)
        if self.tp is not None:
            shape = shape.with_tp(*self.tp)
        return replace(shape, mean_run=self.mean_run) if self.mean_run else shape

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
        return self.device

    @property
    def memory(self) -> str:
        return "VRAM" if self.resolved_device() == "cuda" else "DRAM"

    def ranks(self) -> tuple[int, int]:
        """The source and destination ranks the demo pairs: ranks that share a shard between TP sizes."""
        model = self.model()
        return paired_ranks(model.src_tp, model.dst_tp) if model.src_tp != model.dst_tp else (0, 0)

    def sources(self) -> list[int]:
        """The source ranks that send: the paired one, or with ``gather`` every rank of the
        destination rank's group (docs/tp_state.md §4)."""
        model, (src_rank, dst_rank) = self.model(), self.ranks()
        if not self.gather:
            return [src_rank]
        return [r for r in range(model.src_tp) if partner_rank(r, model.src_tp, model.dst_tp) == dst_rank]

    def source_seed(self, src_rank: int) -> int:
        """The seed of a source rank's pool bytes (each rank of a gather holds its own)."""
        return self.seed + src_rank if self.gather else self.seed

    def batch(self, requests: int | None = None, prompt_len: int | None = None, src_rank: int | None = None) -> Batch:
        """The demo's batch (or a smaller one of the same shape and ranks; ``src_rank``: another source's)."""
        paired, dst_rank = self.ranks()
        lens = list(self.prompt_len) if isinstance(self.prompt_len, tuple) else self.prompt_len
        return build_batch(self.model(), requests or self.requests, prompt_len or lens, chunks=self.chunks,
                           prefix_len=self.prefix_len if prompt_len is None else 0, seed=self.seed,
                           src_rank=paired if src_rank is None else src_rank, dst_rank=dst_rank,
                           dst_page_size=self.dst_page_size)


@dataclass
class DemoReport:
    config: DemoConfig
    device: str = ""
    transfers: int = 0
    descriptors: int = 0
    nbytes: int = 0
    mode: str = ""
    kvplan_ms: float | None = None
    baseline_ms: float | None = None
    warm_up_s: float | None = None  # the prefill endpoint's warm_up() (None: not called)
    transfer_s: float | None = None  # the first batch (after the warm-up, when there is one)
    steady_s: float | None = None  # median of the later batches (``repeat`` > 1)
    batch_s: list[float] = field(default_factory=list)  # every batch's time, in order
    forward_s: float | None = None  # the stand-in forward pass (median over batches)
    exposed_s: float | None = None  # from its end until the decode side had every request (median)
    exposed_each_s: list[float] = field(default_factory=list)  # the same, batch by batch (the first included)
    mode_used: str | None = None  # what ``auto`` chose
    states: dict[Any, str] = field(default_factory=dict)
    failures: dict[Any, str | None] = field(default_factory=dict)
    send_failures: dict[Any, str | None] = field(default_factory=dict)
    refused: str | None = None
    verified: bool | None = None
    role: str = "both"  # or the one side this command ran ("decode", "prefill": run_role)

    @property
    def ok(self) -> bool:
        complete = bool(self.states) and set(self.states.values()) == {"complete"}
        return complete and (self.verified is True or self.role == "prefill")  # (the decode side verifies)

    def drill_observed(self) -> str | None:
        """For a fault drill: what was observed when it is exactly the expected failure, else ``None``."""
        fault = self.config.fault
        failed = {r: why or "" for r, why in self.failures.items() if self.states.get(r) == "failed"}
        every = bool(self.states) and len(failed) == len(self.states)

        def all_say(*words: str) -> bool:
            return every and all(any(w in why for w in words) for why in failed.values())

        expected = {
            "dead-decode": bool(self.send_failures) and all(self.send_failures.values()),
            "dead-prefill": all_say("the prefill side is gone", "could not be published"),
            "dead-prefill-mid": all_say("the prefill side is gone"),
            "dead-decode-mid": bool(failed) and all("the decode side is gone" in why for why in failed.values()),
            "bad-registration": bool(self.refused) and all_say("refused the pairing"),
            "deadline": all_say("deadline passed"),
        }.get(fault, False)
        if not expected:
            return None
        return f"{fault}: {len(failed)} of {len(self.states)} requests failed as expected ({next(iter(failed.values()))})"

    def render(self) -> str:
        c = self.config
        model = c.model()
        pages = (f"page size {model.page_size}" if not self.config.dst_page_size else
                 f"page size {model.page_size} to {self.config.dst_page_size}")
        lines = [f"kvplan demo: {model.name} ({model.layers} layers, {pages}), "
                 f"{c.engine} {c.mode}{f' ({self.mode_used})' if self.mode_used and self.mode_used != c.mode else ''}, "
                 f"{self.device} memory, {c.host}" + (f", {self.role} side" if self.role != "both" else "")]
        if self.role == "decode":  # the prefill side plans and sends: its command reports those
            lines.append(f"  requests      {c.requests} x {c.prompt_len} tokens, from the prefill command")
        else:
            used = self.mode_used or c.mode
            form = {"staged": f"{self.mode} descriptors, moved through staging slots",
                    "prepared": f"{self.mode} descriptors, posted as NIXL prepared lists"}.get(
                used.split(",")[0], f"{self.mode} descriptors")
            lines.append(f"  requests      {c.requests} x {c.prompt_len} tokens in {self.transfers} chunks ({form})")
            lines.append(f"  descriptors   {self.descriptors:,}   bytes {self.nbytes:,}")
        if self.kvplan_ms is not None:
            where = "GPU" if self.device == "cuda" else "CPU, Triton interpreter: not a speed measurement"
            why = "different page sizes" if self.config.dst_page_size else "head-sliced"
            base = f"{self.baseline_ms:.2f} ms" if self.baseline_ms is not None else f"n/a ({why})"
            lines.append(f"  plan latency  kvplan {self.kvplan_ms:.2f} ms ({where}); SGLang-style {base}")
        if self.warm_up_s is not None:
            lines.append(f"  warm-up       {self.warm_up_s * 1e3:.1f} ms (the prefill endpoint's warm_up(), before the "
                         "first batch)")
        if self.transfer_s:
            lines.append(f"  transfer      {self.transfer_s * 1e3:.1f} ms, {self.nbytes / self.transfer_s / 2**30:.3f} GiB/s"
                         + (" (first batch)" if self.steady_s else ""))
        if self.steady_s:
            lines.append(f"  steady        {self.steady_s * 1e3:.1f} ms, {self.nbytes / self.steady_s / 2**30:.3f} GiB/s "
                         f"(median of batches 2..{c.repeat})")
            later = sorted(self.batch_s[1:])
            if len(later) >= 4:  # the spread of the later batches: a median can hide a slow half
                lines.append(f"  spread        {later[0] * 1e3:.2f} .. {later[len(later) // 10] * 1e3:.2f} (p10) .. "
                             f"{later[(9 * len(later)) // 10] * 1e3:.2f} (p90) .. {later[-1] * 1e3:.2f} ms")
        if self.forward_s is not None and self.exposed_s is not None:
            how = (f"streamed in {c.layer_groups} layer groups ({c.layer_split}: {c.groups().sizes} "
                   f"layers)" if c.layer_groups else "sent after the forward pass")
            lines.append(f"  forward       {self.forward_s * 1e3:.1f} ms (stand-in, {model.layers} layers); {how}")
            lines.append(f"  exposed       {self.exposed_s * 1e3:.1f} ms from the end of the forward pass to decode-ready")
        if self.refused:
            lines.append(f"  pairing       refused: {self.refused}")
        done = sum(1 for s in self.states.values() if s == "complete")
        lines.append(f"  completed     {done} of {len(self.states)} requests")
        for request, reason in self.failures.items():
            if reason:
                lines.append(f"  FAILED        {request}: {reason}")
        verdict = {True: "every byte matches", False: "WRONG BYTES",
                   None: "on the decode side" if self.role == "prefill" else "not checked"}[self.verified]
        lines.append(f"  verification  {verdict}")
        lines.append("  result        " + ("OK" if self.ok else "FAILED"))
        return "\n".join(lines)


def _child_setup(config: DemoConfig) -> None:
    """Engine settings and the parent's log level in a spawned process (UCX kept on the loopback
    device only where the demo runs on loopback)."""
    for key, value in ENGINE_ENV:
        if key != "UCX_NET_DEVICES" or is_loopback(config.host):
            os.environ.setdefault(key, value)
    level = env.get("KVPLAN_LOG_LEVEL")
    if level:
        logging.basicConfig(level=level, format="%(levelname)s %(processName)s %(message)s")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this machine's loopback: the tools choose UCX's
    loopback device only then (a run bound to a real address leaves UCX its own choice)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: UCX chooses
        return False


def source_pools(config: DemoConfig, batch: Batch, device: str, rank: int) -> tuple[SideMemory, list[torch.Tensor]]:
    """Source rank ``rank``'s pools, with bytes as a real model's ranks hold them: in a gather, each
    rank's own bytes where TP gives it its own part (KV and SWA head slices, sharded Mamba tensors),
    the same bytes on every rank where the model replicates them (an MLA latent, replicated heads or
    items, DSA and ring rows, aux), since every rank of the group writes those."""
    side, own = materialize(batch.src, device, seed=config.source_seed(rank))
    if not config.gather:
        return side, own
    _, shared = materialize(batch.src, device, seed=config.seed)
    kv = side.kv
    kv_own = kv.attention is Attention.MHA and kv.num_kv_heads >= kv.tp_size
    per_rank = [kv_own] * len(kv.entries)
    for c in side.state:
        rules = rules_of(c.kind)
        sharded = [rules.shards_tensors and bool(c.shards) and c.shards[i].dim != 0 for i in range(len(c.entries))]
        per_rank += [(rules.slices_heads and kv_own) or own_part for own_part in sharded]
    per_rank += [False] * len(side.aux)
    for mine, tensor, common in zip(per_rank, own, shared):
        if not mine:
            tensor.copy_(common)
    return side, own


def decode_process(config: DemoConfig, conn) -> None:
    """The receiving side: publish, wait, verify; every outcome goes back through ``conn``."""
    try:
        _child_setup(config)
        device = config.resolved_device()
        if device == "cuda" and config.decode_gpu:
            torch.cuda.set_device(config.decode_gpu)  # kernels launch on the current device
            device = f"cuda:{config.decode_gpu}"
        batch = config.batch()
        side, dst_tensors = materialize(batch.dsts[0], device)
        side = side.to(device)
        if config.fault == "bad-registration":
            side = replace(side, aux=())
        staging = torch.zeros(config.staging_bytes, dtype=torch.uint8, device=device) if config.mode == "staged" or config.mode == "auto" and device != "cpu" else None
        senders = config.sources()
        channels = [ControlChannel(host=config.host, bind_port=config.port or None) for _ in senders]
        endpoint = DecodeEndpoint(side, make_engine(config.engine, "decode", config.memory,
                                                    **config.engine_settings(config.decode_gpu)), channels, staging,
                                  integrity=config.integrity)
        conn.send(("port", [c.port for c in channels]))
        endpoint.register(timeout=config.timeout + 60)  # the prefill process may still be starting
        if config.warm_up:
            endpoint.warm_up(*config.warm_bound(), timeout=config.timeout)
        last = {t.request: t for t in batch.transfers if t.last}
        timeout = 3.0 if config.fault in ("deadline", "dead-prefill") else config.timeout
        states, failures, ready = {}, {}, []
        with Profile("decode"):
            for k in range(config.repeat):
                tag = config.round_ids(k)
                endpoint.publish([PreallocatedRequest(f"{r}{tag}", t.src_row, t.prompt_len, t.prefix_len, t.aux_dst)
                                  for r, t in last.items()], timeout=timeout,
                                 peer=list(range(len(senders))) if config.gather else 0)
                conn.send(("stage", "publish lists"))
                if config.fault == "dead-decode-mid":  # die once the first request is complete
                    deadline = time.monotonic() + config.timeout
                    while time.monotonic() < deadline:
                        endpoint.poll()
                        if "complete" in endpoint.tracker.states().values():
                            time.sleep(0.2)  # dies once the credit of its completed request has left
                            os._exit(0)
                states.update(endpoint.wait())
                ready.append(time.monotonic())
                if env.enabled("KVPLAN_TRACE"):
                    log.warning("decode ready (clock ms): %.3f", ready[-1] * 1e3)
                    endpoint.log_trace()
                failures.update(endpoint.failures)
                if any(v != "complete" for v in states.values()):
                    break
        conn.send(("stage", "complete"))
        verified = None
        if all(s == "complete" for s in states.values()):
            expected = AddressSpace.of_tensors(dst_tensors, zero=True)
            for rank in senders:  # every source rank's plan, executed by the reference
                sent = config.batch(src_rank=rank)
                src, src_tensors = source_pools(config, sent, device, rank)
                real = Batch(src, (replace(side, req_to_token=batch.dsts[0].req_to_token),), sent.transfers)
                execute(plan_reference(real).descriptors()[0], AddressSpace.of_tensors(src_tensors), expected)
            verified = expected.matches(dst_tensors)
        conn.send(("result", states, failures, verified, ready))
    except Exception:  # noqa: BLE001 - reported to the parent process
        conn.send(("error", traceback.format_exc()))
    conn.poll(60)


def prefill_process(config: DemoConfig, port: int, conn, src_rank: int | None = None) -> None:
    """The sending side (source rank ``src_rank``, else the paired one): pair, receive lists, plan
    (and time it), move the batch."""
    try:
        _child_setup(config)
        device = config.resolved_device()
        batch = config.batch(src_rank=src_rank)
        side, src_tensors = source_pools(config, batch, device, config.ranks()[0] if src_rank is None else src_rank)
        side = side.to(device)
        forward = None
        if config.forward:
            groups = config.groups()
            tokens = sum(t.prompt_len for t in batch.transfers if t.last)
            forward = StandInForward(side, src_tensors, groups, config.forward_dim, tokens)
        staging = torch.zeros(config.staging_bytes, dtype=torch.uint8, device=device) if config.mode == "staged" or config.mode == "auto" and device == "cuda" else None
        endpoint = PrefillEndpoint(side, make_engine(config.engine, "prefill", config.memory, **config.engine_settings()), ControlChannel(port, host=config.host), staging,
                                   slots=config.staging_slots, receiver_plans=not config.scatter_tables)
        try:
            endpoint.accept(timeout=config.timeout)
        except Exception as err:  # noqa: BLE001 - a refused pairing is an outcome to report
            conn.send(("refused", f"{type(err).__name__}: {err}"))
            conn.poll(60)
            return
        conn.send(("stage", "pair"))
        if config.fault == "dead-prefill":
            os._exit(0)
        started = time.perf_counter()
        if config.warm_up:
            endpoint.warm_up(*config.warm_bound(), timeout=config.timeout)
        warm_s = time.perf_counter() - started if config.warm_up else None
        endpoint.receive_requests(config.requests, timeout=config.timeout)
        tag = config.round_ids(0)
        transfers = [endpoint.transfer(Chunk(f"{t.request}{tag}", t.src_row, t.start, t.fill_len, t.prompt_len,
                                             t.last, t.aux_src)) for t in batch.transfers]
        planned = Batch(side, (endpoint.peer_side,), tuple(transfers))
        plan_started = time.perf_counter()
        descs = eager.plan(planned).descriptors()[0]
        # on a GPU, the median of timed runs after a warm-up; on the CPU, where the kernels run
        # interpreted and the figure says little, the one plan made anyway (planning again only costs)
        cuda = device == "cuda"
        kvplan_ms = median_ms(lambda: eager.plan(planned).descriptors(), 5) if cuda else \
            (time.perf_counter() - plan_started) * 1e3
        direct = pair_sides(side, endpoint.peer_side).mode is Mode.DIRECT
        same_pages = endpoint.peer_side.kv.page_size == side.kv.page_size  # SGLang refuses a mismatch
        baseline_ms = median_ms(lambda: sglang_style_descs(planned), 5 if cuda else 1, warmup=2 if cuda else 0) \
            if direct and same_pages else None
        conn.send(("planned", len(transfers), len(descs), int(descs[:, 2].sum()) if len(descs) else 0,
                   "direct" if direct else "head-sliced", kvplan_ms, baseline_ms, warm_s))
        if not conn.poll(config.timeout * 2) or conn.recv() != "go":
            return
        result, times, spans = {}, [], []
        with Profile("prefill"):
            for k in range(config.repeat):
                tag = config.round_ids(k)
                if k:
                    endpoint.receive_requests(config.requests, timeout=config.timeout)
                chunks = [endpoint.transfer(Chunk(f"{t.request}{tag}", t.src_row, t.start, t.fill_len, t.prompt_len,
                                                  t.last, t.aux_src)) for t in batch.transfers]
                if config.fault == "dead-prefill-mid":  # the first chunks only, then die
                    conn.send(("sent", endpoint.send([c for c in chunks if not c.last], config.mode, config.timeout), [1.0],
                               endpoint.last_mode, []))
                    os._exit(0)
                t0 = time.perf_counter()
                if config.fault == "dead-decode-mid":  # one request lands; the rest go once the decode has died
                    first = [c for c in chunks if c.request == chunks[0].request]
                    sent = endpoint.send(first, config.mode, timeout=config.timeout)
                    gone_by = time.monotonic() + config.timeout
                    while not endpoint.channel.peer_gone() and time.monotonic() < gone_by:
                        endpoint.channel.wait_readable(0.05)
                    sent.update(endpoint.send([c for c in chunks if c.request != chunks[0].request], config.mode,
                                              timeout=config.timeout))
                elif forward is not None:
                    sent, span = _behind_forward(endpoint, forward, chunks, config)
                    spans.append(span)
                else:
                    sent = endpoint.send(chunks, config.mode, timeout=config.timeout)
                times.append(time.perf_counter() - t0)
                endpoint.forget(list(sent))
                result.update(sent)
                if any(sent.values()):
                    break
        used = endpoint.last_mode
        if used == "staged":
            used += {"planned": ", receiver-planned scatter", "table": ", destination tables sent"}[endpoint.last_announcement]
            if endpoint.waves_ahead:
                used += f", {endpoint.waves_ahead} waves gathered ahead of their marks"
            if endpoint.first_waves_ahead:
                used += f", {endpoint.first_waves_ahead} first waves gathered behind their plans"
            if endpoint.gathers_replayed:
                used += f" ({endpoint.gathers_replayed} as graphs)"
            if all(p.credits_by_engine for p in endpoint.peers):
                used += ", credits through the engine"
        elif used == "direct" and endpoint.launches_ahead:
            used += f", {endpoint.launches_ahead} launched behind their plans"
        conn.send(("sent", result, times, used, spans))
    except Exception:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))
    conn.poll(60)


def _behind_forward(endpoint: PrefillEndpoint, forward: StandInForward, chunks, config: DemoConfig
                    ) -> tuple[dict[Any, str | None], tuple[float, float]]:
    """Send a batch that a stand-in forward pass writes: streamed in layer groups while it runs, or
    after it has ended. Returns the send's result and the pass's ``(started, ended)``."""
    forward.clear()
    streaming = forward.streaming()  # its inputs event, recorded before the pass is queued
    forward.start()
    if config.layer_groups:
        sent = endpoint.send(chunks, config.mode, timeout=config.timeout, layers=streaming)
        span = forward.join(config.timeout)
    else:
        span = forward.join(config.timeout)
        sent = endpoint.send(chunks, config.mode, timeout=config.timeout)
    if env.enabled("KVPLAN_TRACE"):  # on the traces' clock (CLOCK_MONOTONIC, as perf_counter here)
        log.warning("forward pass (start, end clock ms): %.3f %.3f", span[0] * 1e3, span[1] * 1e3)
    return sent, span


class _Progress:
    """A one-line progress bar on standard error (silent when not a terminal unless forced)."""

    def __init__(self, enabled: bool):
        self.enabled, self.done = enabled, 0

    def stage(self, name: str) -> None:
        if STAGES.index(name) + 1 <= self.done:
            return
        self.done = STAGES.index(name) + 1
        if self.enabled:
            bar = "#" * (3 * self.done) + "." * (3 * (len(STAGES) - self.done))
            sys.stderr.write(f"\r[{bar}] {self.done}/{len(STAGES)} {name:<14}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


class Processes:
    """The processes of a run (a decode, and a prefill per sending source rank), each joined or
    killed by its own handle."""

    def __init__(self, config: DemoConfig):
        self.decode_conn, there = child_pipe()
        self.decode = start_child(decode_process, config, there)
        kind, ports = self.recv(self.decode_conn, "decode", config.timeout + 60)
        self.prefill_conns, self.prefills = [], []
        for rank, port in zip(config.sources(), ports):
            conn, there = child_pipe()
            self.prefill_conns.append(conn)
            self.prefills.append(start_child(prefill_process, config, port, there, rank if config.gather else None))

    @property
    def prefill_conn(self):
        """The (first) prefill process's pipe."""
        return self.prefill_conns[0]

    def from_prefills(self, timeout: float) -> list:
        """One message from every prefill process."""
        return [self.recv(conn, "prefill", timeout) for conn in self.prefill_conns]

    recv = staticmethod(child_message)

    def kill_decode(self) -> None:
        self.decode.kill()
        self.decode.join(5)

    def close(self) -> None:
        for conn in (self.decode_conn, *self.prefill_conns):
            try:
                conn.send("bye")
            except (BrokenPipeError, OSError):
                pass
        for proc in (self.decode, *self.prefills):
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def run_demo(config: DemoConfig, progress: bool = False) -> DemoReport:
    """Run both processes to the end and report (raises only on a crash of either process)."""
    if config.fault not in FAULTS:
        raise ValueError(f"unknown fault {config.fault!r}; choose one of {', '.join(FAULTS)}")
    report = DemoReport(config, device=config.resolved_device())
    bar = _Progress(progress)
    wait = config.timeout + 120  # process start-up, imports and interpreted kernels on a small machine
    procs = None
    spans: list = []  # the stand-in forward passes' (started, ended)
    try:
        bar.stage("start decode")
        procs = Processes(config)
        bar.stage("start prefill")
        paired = procs.from_prefills(wait)
        refused = [m[1] for m in paired if m[0] == "refused"]
        if refused:
            report.refused = refused[0]
        else:
            bar.stage("pair")
            if config.fault != "dead-prefill":
                planned = procs.from_prefills(wait)  # each source rank's part: counted together
                _, report.transfers, _, _, report.mode, report.kvplan_ms, report.baseline_ms, report.warm_up_s = planned[0]
                report.descriptors, report.nbytes = sum(m[2] for m in planned), sum(m[3] for m in planned)
                bar.stage("publish lists")  # (the prefill plans once it has the decode's lists)
                bar.stage("plan")
                if config.fault == "dead-decode":
                    procs.kill_decode()
                if config.fault != "deadline":
                    for conn in procs.prefill_conns:
                        conn.send("go")
                    sent = procs.from_prefills(wait)
                    report.mode_used, spans = sent[0][3], sent[0][4]
                    for m in sent:
                        for request, why in m[1].items():
                            report.send_failures[request] = report.send_failures.get(request) or why
                    times = [max(each) for each in zip(*(m[2] for m in sent))]  # a batch is sent when all have sent it
                    report.transfer_s = times[0]
                    report.steady_s = statistics.median(times[1:]) if len(times) > 1 else None
                    report.batch_s = times
                    bar.stage("transfer")
        if config.fault == "dead-decode":
            report.states = {r: "failed" for r in report.send_failures}
            report.failures = dict(report.send_failures)
        elif config.fault == "dead-decode-mid":  # the prefill's view: what it reported sent or failed
            report.states = {r: "failed" if why else "complete" for r, why in report.send_failures.items()}
            report.failures = dict(report.send_failures)
        else:
            while (msg := procs.recv(procs.decode_conn, "decode", wait))[0] == "stage":
                bar.stage(msg[1])
            _, report.states, report.failures, report.verified, ready = msg
            if spans and len(ready) == len(spans):
                later = slice(1 if len(spans) > 1 else 0, None)  # the first pass warms up, when there are more
                report.forward_s = statistics.median(end - start for start, end in spans[later])
                report.exposed_each_s = [r - end for r, (_, end) in zip(ready, spans)]
                report.exposed_s = statistics.median(report.exposed_each_s[later])
            bar.stage("verify")
    finally:
        bar.close()
        if procs is not None:
            procs.close()
    return report


class _RoleConn:
    """The parent's pipe, for a side that runs alone (:func:`run_role`): it keeps what the side reports,
    shows its stages, and answers "go" when the prefill asks."""

    def __init__(self, show: Any) -> None:
        self.messages: list[tuple] = []
        self.show = show

    def send(self, msg: Any) -> None:
        self.messages.append(msg)
        if msg[0] == "stage":
            self.show(msg[1])

    def poll(self, timeout: float | None = None) -> bool:
        return True

    def recv(self) -> str:
        return "go"

    def last(self, kind: str) -> tuple | None:
        return next((m for m in reversed(self.messages) if m[0] == kind), None)


def run_role(config: DemoConfig, role: str, peer_port: int = 0, progress: bool = False) -> DemoReport:
    """Run one side of the demo in this process, the other being a command on another machine: the
    decode listens on ``config.host:config.port``; the prefill connects to ``config.host:peer_port``.
    Both rebuild the same batch from the same settings (seed included). Only the decode verifies
    bytes; the prefill reports what it sent."""
    if role not in ("decode", "prefill"):
        raise ValueError(f"a role is 'decode' or 'prefill', not {role!r}")
    bar = _Progress(progress)
    report = DemoReport(config, device=config.resolved_device(), role=role)
    conn = _RoleConn(bar.stage)
    try:
        if role == "decode":
            decode_process(config, conn)
        else:
            prefill_process(config, peer_port, conn)
    finally:
        bar.close()
    if (error := conn.last("error")) is not None:
        raise RuntimeError(f"the {role} side failed:\n{error[1]}")
    if role == "decode":
        _, report.states, report.failures, report.verified, _ = conn.last("result")
        return report
    if (refused := conn.last("refused")) is not None:
        report.refused = refused[1]
        return report
    _, report.transfers, _, report.nbytes, report.mode, report.kvplan_ms, report.baseline_ms, report.warm_up_s = \
        conn.last("planned")
    report.descriptors = conn.last("planned")[2]
    _, sent, times, report.mode_used, _ = conn.last("sent")
    report.send_failures = dict(sent)
    report.states = {r: "failed" if why else "complete" for r, why in sent.items()}
    report.failures = {r: why for r, why in sent.items() if why}
    report.transfer_s, report.batch_s = (times[0] if times else None), list(times)
    return report
