"""What a ``kvplan demo`` run is asked to do (:class:`DemoConfig`): the model shape and batch, the
engine and mode, the fault drill, the hosts; and whether a host is this machine's loopback.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..planner.contract.layer_groups import LayerGroups
from ..planner.contract.batch import Batch
from ..planner.contract.tensor_slices import partner_rank
from ..transport.control_wire import is_loopback
from .scenarios import PRESETS, ModelShape, build_batch, paired_ranks

__all__ = ["DEMO_HOST", "DemoConfig", "ENGINE_ENV", "FAULTS", "STAGES", "default_timeout", "is_loopback"]

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


# staged copies under Triton's interpreter: ~2 MB/s measured on 2 cores, 0.7 MB/s on a slower day (each
# receiver-planned scatter of the default demo took 20-25 s); a quarter of a MB/s leaves room
INTERPRETED_BYTES_PER_S = 0.25e6
# head-sliced planning under the interpreter (a descriptor per token and entry): 0.13-0.19 ms a descriptor
# on an idle 2-core machine (the three tp4to8 presets, 131-139 thousand descriptors: 16-20 s of planning,
# 17-26 s of transfer), about 0.7 ms on a loaded one; a millisecond leaves room
INTERPRETED_SLICED_DESCRIPTOR_S = 1e-3


def default_timeout(config) -> float:
    """60 s; on the CPU, where the kernels run interpreted, plus 1 ms per descriptor where the sides' TP
    sizes differ (head-sliced: a descriptor per token and entry) and, for staged mode, 4 s per MB of KV."""
    if config.resolved_device() != "cpu":
        return 60.0
    shape = config.model()
    longest = max(config.prompt_len) if isinstance(config.prompt_len, tuple) else config.prompt_len
    entries = shape.layers * shape.attention.parts
    timeout = 60.0
    if shape.src_tp != shape.dst_tp:
        timeout += config.requests * longest * entries * INTERPRETED_SLICED_DESCRIPTOR_S
    if config.mode == "staged":
        timeout += config.requests * longest * shape.token_bytes * entries / INTERPRETED_BYTES_PER_S
    return timeout
