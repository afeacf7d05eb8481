"""What a ``kvplan load`` run is asked to do (:class:`LoadConfig`) and its arrivals: when each request
comes, how long its prompt and cached prefix are, when its chunks are ready and when its fault strikes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["Arrival", "FAULTS", "KV_SHAPES", "LoadConfig", "compute_s", "fault_at", "schedule"]


FAULTS = ("abort", "deadline")

#: ``kvplan load --preset``: the KV a token holds, as ``(layers, bytes per K or V entry of a layer, page size)``.
#: ``tiny`` is the protocol's cost alone (64-byte entries: 512 B a token); ``llama8b`` is Llama-3.1-8B's KV
#: in bf16 (32 layers, 8 KV heads of 128: 2 KiB an entry, 128 KiB a token), what a served request carries.
KV_SHAPES = {"tiny": (4, 64, 16), "llama8b": (32, 2048, 16)}


@dataclass(frozen=True)
class LoadConfig:
    """One load run. Sizes are per side; the pools hold ``rows`` requests of ``prompt_max`` tokens."""

    rate: float = 20.0  # arrivals a second
    duration: float = 5.0  # seconds of arrivals
    decodes: int = 2
    engine: str = "nixl"
    mode: str = "auto"
    device: str = "auto"
    layers: int = 4
    page_size: int = 16
    token_bytes: int = 64  # per token, per K or V entry of a layer
    prompt_median: int = 512  # tokens (log-normal, sigma 0.6)
    prompt_max: int = 2048
    chunk_tokens: int = 256  # chunked prefill (a multiple of the page size)
    prefix_share: float = 0.25  # requests with a decode-side cached prefix
    fault_every: int = 8  # every n-th request gets the next fault of FAULTS (0: none)
    kill_at: float = 0.0  # seconds into the run at which the last decode is killed (0: never; needs 2 decodes)
    forward_tokens_per_s: float = 100_000.0  # the stand-in forward pass: when each chunk is ready
    rows: int = 32  # requests a decode holds at once (the prefill: as many as all decodes)
    queue: int = 0  # arrivals a decode lets wait for a row; one more is refused as overload (0: as many as rows)
    staging_mib: int = 32
    timeout: float = 30.0  # each request's deadline on both sides
    sample_s: float = 0.5
    seed: int = 0
    host: str = "127.0.0.1"
    engine_extra: tuple[tuple[str, Any], ...] = ()
    integrity: bool = False  # per-request checksums compared at decode-ready (kvplan.transport.integrity)
    merge_ready: bool = True  # a request's chunks that are ready together go as one span (False: one chunk a turn)
    in_flight: int = 2  # the prefill's batches submitted and not yet ended; what is ready meanwhile waits for the next
    warm_up: bool = True  # both sides' warm_up() before the run, as a serving engine at start-up (kernels, graphs)

    def resolved_device(self) -> str:
        return ("cuda" if torch.cuda.is_available() else "cpu") if self.device == "auto" else self.device

    def engine_settings(self) -> dict[str, Any]:
        settings = {"local_hostname": self.host} if self.engine == "mooncake" else {}
        return {**settings, **dict(self.engine_extra)}


@dataclass(frozen=True)
class Arrival:
    """One request of the schedule."""

    index: int
    request: str
    at: float  # seconds after the run's start
    prompt_len: int
    prefix_len: int
    decode: int
    fault: str | None


def schedule(config: LoadConfig) -> list[Arrival]:
    """The run's arrivals, the same in every process (from ``seed``)."""
    rng = np.random.default_rng(config.seed)
    out, at, ps = [], 0.0, config.page_size
    while True:
        at += rng.exponential(1.0 / config.rate)
        if at > config.duration:
            return out
        k = len(out)
        length = int(np.clip(rng.lognormal(math.log(config.prompt_median), 0.6), ps + 1, config.prompt_max))
        prefix = 0
        if rng.random() < config.prefix_share and length > 2 * ps:
            prefix = int(rng.integers(1, (length - 1) // ps)) * ps
        fault = FAULTS[(k // config.fault_every) % len(FAULTS)] if config.fault_every and \
            k % config.fault_every == config.fault_every - 1 else None
        out.append(Arrival(k, f"q{k}", at, length, prefix, int(rng.integers(config.decodes)), fault))


SLOW = 20  # a faulted request's stand-in forward pass runs this many times slower: its fault lands mid-transfer


def compute_s(config: LoadConfig, arrival: Arrival, tokens: int) -> float:
    """How long the stand-in forward pass takes for ``tokens`` of ``arrival``."""
    return tokens / config.forward_tokens_per_s * (SLOW if arrival.fault else 1)


def fault_at(config: LoadConfig, arrival: Arrival) -> float:
    """When (seconds after the run's start) the decode aborts an ``abort`` request, or its deadline
    passes for a ``deadline`` one: halfway through its forward pass."""
    return arrival.at + 0.5 * compute_s(config, arrival, arrival.prompt_len - arrival.prefix_len)
