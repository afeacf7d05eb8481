"""``kvplan load``: serving-shaped load through real endpoints, with faults on a schedule.

One prefill process sends to ``decodes`` decode processes (fan-out), each its own process with its
own engine and control channel. Requests arrive at ``rate`` a second for ``duration`` seconds
(Poisson), with prompt lengths from a log-normal distribution, a decode-side cached prefix for a
share of them, and chunked prefill: a stand-in forward pass writes each chunk's KV (a known byte
per token, layer and request) at the chunk's ready time, and the prefill sends every chunk that
is ready in one batch. Each decode allocates pages and a row per request from free lists, publishes
them, checks every byte of a completed request, and releases its pages, a failed request's only
once :meth:`~kvplan.transport.decode.DecodeEndpoint.fenced`. Faults cycle over the requests
(``fault_every``): the decode aborts the request mid-transfer, or gives it a deadline it cannot
meet; ``kill_at`` kills the last decode process mid-run, and the other decodes' requests go on.

Reported: throughput, latency from a request's last chunk being ready to the decode seeing it
complete (p50, p99; one host's monotonic clock), failures by cause, and per process over time: RSS,
open file descriptors and sockets, the engine's registered regions, peers and kept handles, GPU
memory, and the endpoints' per-request tables (``footprint``), which must come back to empty.

Example::

    report = run_load(LoadConfig(rate=10, duration=3, decodes=2, device="cpu"))
    assert report.ok, report.problems
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import sys
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import InputError, KvplanError
from ..planner.device.destinations import PreallocatedRequest
from ..planner.contract.batch import Attention, Entry, KVLayout, SideMemory
from ..transport.control import MAX_REFUSED, ControlChannel
from ..transport.endpoints import Chunk, DecodeEndpoint, PrefillEndpoint
from ..transport.engines import make_engine
from ..transport.stats import cause_of
from ..profiling import Profile
from .demo import is_loopback
from .target_process import child_message, child_pipe, start_child

__all__ = ["Arrival", "LoadConfig", "LoadReport", "run_load", "schedule"]

log = logging.getLogger(__name__)

FAULTS = ("abort", "deadline")
TURN_S = 0.02  # the longest a decode's turn waits for a request to end when nothing else is due
FENCE_LOOK_S = 0.002  # ... while a failed request's fence is awaited (fenced() is a read: looked at this often)
FENCE_WAIT_S = 10.0  # a failed request's pages wait this long for their fence, then stay out of use (counted)


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


WARM_TRANSFERS = 256  # the largest batch both sides' warm-up readies (a turn's batch is rarely larger)
HOST_CHECK_EVERY = 16  # every n-th request's bytes are checked on the host too, one torch call per entry
SLOW = 20  # a faulted request's stand-in forward pass runs this many times slower: its fault lands mid-transfer


def compute_s(config: LoadConfig, arrival: Arrival, tokens: int) -> float:
    """How long the stand-in forward pass takes for ``tokens`` of ``arrival``."""
    return tokens / config.forward_tokens_per_s * (SLOW if arrival.fault else 1)


def fault_at(config: LoadConfig, arrival: Arrival) -> float:
    """When (seconds after the run's start) the decode aborts an ``abort`` request, or its deadline
    passes for a ``deadline`` one: halfway through its forward pass."""
    return arrival.at + 0.5 * compute_s(config, arrival, arrival.prompt_len - arrival.prefix_len)


def _pattern(arrival: Arrival, entry: int, tokens: torch.Tensor) -> torch.Tensor:
    """The byte every position of a token's item holds: per request, entry and token, never 0."""
    return ((arrival.index * 131 + entry * 17 + tokens) % 251 + 1).to(torch.uint8)


class _Pools:
    """One side's pools for ``rows`` requests of ``prompt_max`` tokens: K and V per layer (``[pages,
    page_size, token_bytes]``), one aux entry of a row per request, the token table, and free lists
    of pages and rows (page 0 and row 0 are never handed out)."""

    def __init__(self, config: LoadConfig, device: str, rows: int):
        self.config, self.device = config, device
        ps, tb = config.page_size, config.token_bytes
        pages = rows * math.ceil(config.prompt_max / ps) + 1
        # every K and V entry in one tensor, so that a turn's stand-in writes and checks are one indexed op each
        self.kv_all = torch.zeros(2 * config.layers, pages, ps, tb, dtype=torch.uint8, device=device)
        self.kv = list(self.kv_all.unbind(0))
        self.aux = torch.zeros(rows + 1, 64, dtype=torch.uint8, device=device)
        self.table = torch.zeros(rows + 1, config.prompt_max + 1, dtype=torch.int32, device=device)
        entries = tuple(Entry(t.data_ptr(), ps * tb, pages) for t in self.kv)
        self.side = SideMemory(KVLayout(Attention.MHA, ps, entries, num_kv_heads=1),
                               aux=(Entry(self.aux.data_ptr(), 64, rows + 1),), req_to_token=self.table)
        self.free_pages = deque(range(1, pages))
        self.free_rows = deque(range(1, rows + 1))

    def take(self, length: int) -> tuple[int, list[int]] | None:
        """A row and the pages for ``length`` tokens, written into the token table; None when full."""
        need = math.ceil(length / self.config.page_size)
        if not self.free_rows or len(self.free_pages) < need:
            return None
        row, pages = self.free_rows.popleft(), [self.free_pages.popleft() for _ in range(need)]
        ps = self.config.page_size
        slots = (torch.tensor(pages, dtype=torch.int64)[:, None] * ps + torch.arange(ps)).reshape(-1)[:length]
        self.table[row].zero_()
        self.table[row, :length] = slots.to(torch.int32).to(self.device)
        return row, pages

    def give(self, row: int, pages: list[int]) -> None:
        self.free_rows.append(row)
        self.free_pages.extend(pages)

    def _slots(self, spans: list[tuple[Arrival, int, int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For ``(arrival, row, lo, hi)`` spans: each token's slot and token index, and which span it is of."""
        rows = torch.tensor([row for _, row, _, _ in spans], dtype=torch.int64)
        lens = torch.tensor([hi - lo for _, _, lo, hi in spans], dtype=torch.int64)
        span_of = torch.repeat_interleave(torch.arange(len(spans)), lens)
        starts = torch.tensor([lo for _, _, lo, _ in spans], dtype=torch.int64)
        tokens = starts[span_of] + torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        tokens, span_of, rows = tokens.to(self.device), span_of.to(self.device), rows.to(self.device)
        slots = self.table[rows[span_of], tokens].to(torch.int64)
        return slots, tokens, span_of

    def _expected(self, spans, tokens: torch.Tensor, span_of: torch.Tensor) -> torch.Tensor:
        """``[entries, tokens]``: the byte each token's item holds in each entry (as :func:`_pattern`)."""
        index = torch.tensor([a.index for a, *_ in spans], dtype=torch.int64, device=self.device)[span_of]
        entry = torch.arange(self.kv_all.shape[0], device=self.device)[:, None]
        return ((index[None] * 131 + entry * 17 + tokens[None]) % 251 + 1).to(torch.uint8)

    def write_many(self, spans: list[tuple[Arrival, int, int, int]]) -> None:
        """The stand-in forward pass for a turn: tokens ``[lo, hi)`` of each span, every entry, one write."""
        if not spans:
            return
        ps = self.config.page_size
        slots, tokens, span_of = self._slots(spans)
        self.kv_all[:, slots // ps, slots % ps] = self._expected(spans, tokens, span_of)[..., None]

    def write(self, arrival: Arrival, row: int, lo: int, hi: int) -> None:
        """The stand-in forward pass for tokens ``[lo, hi)`` of one request, in every KV entry."""
        self.write_many([(arrival, row, lo, hi)])

    def check_many(self, done: list[tuple[Arrival, int]]) -> list[bool]:
        """Whether every sent byte of each ``(arrival, row)`` is the one its source wrote, compared on the
        device in one pass over all of them (tokens past the prefix, and the aux row); one copy to the host."""
        if not done:
            return []
        ps = self.config.page_size
        spans = [(a, row, a.prefix_len, a.prompt_len) for a, row in done]
        slots, tokens, span_of = self._slots(spans)
        landed = self.kv_all[:, slots // ps, slots % ps]  # [entries, tokens, token_bytes]
        good = (landed == self._expected(spans, tokens, span_of)[..., None]).all(-1).all(0)
        bad = torch.zeros(len(done), dtype=torch.int64, device=self.device).index_add_(0, span_of, (~good).long())
        rows = torch.tensor([row for _, row in done], dtype=torch.int64, device=self.device)
        aux = torch.tensor([a.index % 251 + 1 for a, _ in done], dtype=torch.uint8, device=self.device)
        aux_good = (self.aux[rows] == aux[:, None]).all(-1)
        return ((bad == 0) & aux_good).tolist()

    def check(self, arrival: Arrival, row: int) -> bool:
        """Whether every sent byte of the request is the one its source wrote (tokens past the prefix,
        and the aux row)."""
        ps = self.config.page_size
        tokens = torch.arange(arrival.prefix_len, arrival.prompt_len, device=self.device)
        slots = self.table[row, arrival.prefix_len : arrival.prompt_len].to(torch.int64)
        for e, pool in enumerate(self.kv):
            if not bool((pool[slots // ps, slots % ps] == _pattern(arrival, e, tokens)[:, None]).all()):
                return False
        return bool((self.aux[row] == arrival.index % 251 + 1).all())


def _resources(engine: Any, endpoint: Any, started: float) -> dict[str, Any]:
    """One sample of what a process holds."""
    fds = os.listdir("/proc/self/fd")
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    gpu = torch.cuda.memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
    stats = engine.stats() if hasattr(engine, "stats") else {}
    return {"t": round(time.monotonic() - started, 2), "rss_kib": rss, "fds": len(fds), "sockets": sockets,
            "gpu_bytes": gpu, **{f"engine_{k}": v for k, v in stats.items()}, **endpoint.footprint()}


def _setup(config: LoadConfig) -> None:
    # (on the handlers: kvplan's modules log through loggers of their own names, under "kvplan", and a
    # logger's filters see only its own records; Python's last-resort handler takes none, hence a handler)
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format="%(levelname)s %(message)s")
    for handler in root.handlers:
        if not any(isinstance(f, _InjectedFaults) for f in handler.filters):
            handler.addFilter(_InjectedFaults(config))
    if is_loopback(config.host):
        os.environ.setdefault("UCX_NET_DEVICES", "lo")  # the run's own choice of loopback (see the demo)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    for var in ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"):
        os.environ.setdefault(var, "65535")


def _side(config: LoadConfig, name: str, rows: int) -> tuple[str, _Pools, torch.Tensor | None, Any]:
    """One process's device, pools of ``rows`` requests, staging buffer (on a GPU, for staged and auto)
    and engine."""
    _setup(config)
    device = config.resolved_device()
    staging = torch.zeros(config.staging_mib << 20, dtype=torch.uint8, device=device) \
        if device == "cuda" and config.mode in ("auto", "staged") else None
    engine = make_engine(config.engine, name, "VRAM" if device == "cuda" else "DRAM", **config.engine_settings())
    return device, _Pools(config, device, rows), staging, engine


class _InjectedFaults(logging.Filter):
    """The endpoints log each failed request as a warning; a failure this run injected is expected, so
    its records are shown only with ``-v``, labelled as injected."""

    def __init__(self, config: LoadConfig):
        super().__init__()
        self.injected = {a.request for a in schedule(config) if a.fault}

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if not any(isinstance(a, str) and a in self.injected for a in args):
            return True
        if not logging.getLogger("kvplan").isEnabledFor(logging.INFO):
            return False
        record.msg = f"(injected fault) {record.msg}"
        record.levelno, record.levelname = logging.INFO, "INFO"
        return True


class _CallerTime:
    """``with caller: endpoint.call(...)``: the wall time the caller's thread spends inside kvplan's calls."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> "_CallerTime":
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds += time.perf_counter() - self._t0


def _go(conn, timeout: float) -> float:
    """Wait for the parent's start (every process counts the schedule from one monotonic instant)."""
    if not conn.poll(timeout):
        raise TimeoutError("the parent never said go")
    return float(conn.recv()[1])


def decode_process(config: LoadConfig, index: int, conn) -> None:
    """Decode ``index``: publish its arrivals as they come, settle, verify, release; report."""
    try:
        device, pools, staging, engine = _side(config, f"load-decode-{index}", config.rows)
        channel = ControlChannel(host=config.host)
        endpoint = DecodeEndpoint(pools.side, engine, channel, staging, integrity=config.integrity)
        conn.send(("port", channel.port))
        endpoint.register(timeout=config.timeout + 60)
        if config.warm_up:
            endpoint.warm_up(WARM_TRANSFERS, config.prompt_max, timeout=config.timeout + 60)
        endpoint.start()  # its progress thread owns the channels and the engine from here: the calls below return at once
        conn.send(("ready",))
        started = _go(conn, config.timeout + 120)
        profile = Profile(f"load-decode-{index}").__enter__()  # (KVPLAN_PROFILE names a folder)
        arrivals = deque(a for a in schedule(config) if a.decode == index)
        live: dict[str, tuple[Arrival, int, list[int]]] = {}
        aborts = {}  # requests with an abort on the schedule, not yet ended: when it is due
        publishes: dict[str, float] = {}  # live requests: when they were published
        unfenced: dict[str, float] = {}  # failed requests whose pages wait for their fence: since when
        outcomes: dict[str, dict[str, Any]] = {}
        samples, quarantined, next_sample = [], 0, 0.0
        caller = _CallerTime()  # the time this thread spends inside kvplan's calls
        bound = config.queue or config.rows
        end = started + config.duration + config.timeout + 30
        while (arrivals or live) and time.monotonic() < end:
            now = time.monotonic() - started
            due: list[tuple[Arrival, int, list[int]]] = []
            while arrivals and arrivals[0].at <= now:
                got = pools.take(arrivals[0].prompt_len)
                if got is None:
                    break  # (full: it waits, as a real decode's queue would)
                due.append((arrivals.popleft(), *got))
            # admission: at most `queue` arrivals wait for a row; the newest beyond are refused at once, before
            # any of their pages exist, so that those admitted meet their deadlines
            waiting = [a for a in itertools.takewhile(lambda a: a.at <= now, arrivals)]
            if len(waiting) > bound:  # (one message for all of a turn's refusals)
                reason = (f"overload: {len(waiting)} requests wait for a row at decode {index} (its queue holds "
                          f"{bound}); refused before any page was taken")
                refused = waiting[bound:][:MAX_REFUSED]
                kept = [arrivals.popleft() for _ in range(bound)]  # (the refused follow the kept in arrivals)
                for a in refused:
                    arrivals.popleft()
                    outcomes[a.request] = {"state": "failed", "at": time.monotonic(), "reason": reason}
                arrivals.extendleft(reversed(kept))
                with caller:
                    endpoint.refuse_all([a.request for a in refused], reason)
            # every due request in one publish (one launch of the destination-list kernels); a request whose
            # deadline fault cuts its deadline short is published alone, with that deadline
            for group in ([d for d in due if d[0].fault != "deadline"], *([d] for d in due if d[0].fault == "deadline")):
                if group:
                    a = group[0][0]
                    deadline = fault_at(config, a) - now if a.fault == "deadline" else config.timeout
                    with caller:
                        endpoint.publish([PreallocatedRequest(a.request, row, a.prompt_len, a.prefix_len, aux_index=row)
                                          for a, row, _ in group], timeout=deadline)
            published_at = time.monotonic()
            for a, row, pages in due:
                live[a.request] = (a, row, pages)
                publishes[a.request] = published_at
                if a.fault == "abort":
                    aborts[a.request] = fault_at(config, a)
            for request in [r for r, at in aborts.items() if now > at]:
                del aborts[request]
                with caller:
                    endpoint.abort(request, "load: an abort on the schedule")  # (it ends at once: polled below)
            with caller:
                ended = endpoint.poll()
            complete: list[tuple[Arrival, int]] = []
            for request, reason in ended.items():
                if request not in live:
                    continue
                aborts.pop(request, None)
                a, row, pages = live[request]
                published = publishes.pop(request, None)
                if reason is None:
                    outcomes[request] = {"state": "complete", "at": time.monotonic(), "published": published}
                    complete.append((a, row))
                else:
                    outcomes[request] = {"state": "failed", "at": time.monotonic(), "reason": reason}
                    unfenced[request] = time.monotonic()
                    with caller:
                        endpoint.abort(request, reason)  # every sender stops and answers: the fence
            # the turn's completed requests checked on the device together, a sample of them on the host too
            for (a, row), ok in zip(complete, pools.check_many(complete)):
                if a.index % HOST_CHECK_EVERY == 0 and pools.check(a, row) != ok:
                    report_error = f"request {a.request}: the device check and the host check disagree"
                    outcomes[a.request]["disagree"] = report_error
                outcomes[a.request]["ok"] = ok
                with caller:
                    endpoint.forget(a.request)
                pools.give(row, live.pop(a.request)[2])
            for request, since in list(unfenced.items()):
                with caller:
                    fenced = endpoint.fenced(request)
                if not fenced and time.monotonic() - since < FENCE_WAIT_S:
                    continue
                a, row, pages = live.pop(request)
                del unfenced[request]
                with caller:
                    endpoint.forget(request)
                if fenced:
                    pools.give(row, pages)
                else:
                    quarantined += 1  # its pages stay out of use
            if now >= next_sample:
                samples.append(_resources(engine, endpoint, started))
                conn.send(("progress", endpoint.stats()))
                next_sample = now + config.sample_s
            # nothing to do until a request ends, the next one arrives or a fence is due to be looked at
            # (one due but held back, its rows full, waits for a request to end)
            until_next = arrivals[0].at - (time.monotonic() - started) if arrivals else TURN_S
            endpoint.wait_ended(min(until_next if until_next > 0 else TURN_S, FENCE_LOOK_S if unfenced else TURN_S))
        profile.__exit__(None, None, None)
        endpoint.close()
        endpoint.log_trace()  # (KVPLAN_TRACE: each wave's steps here, logged once the run's timing is taken)
        samples.append(_resources(engine, endpoint, started))
        conn.send(("progress", {**endpoint.stats(), "caller_s": caller.seconds}))
        conn.send(("result", outcomes, samples, quarantined, len(live) + len(arrivals)))
        conn.poll(60)
        engine.close()
    except Exception:  # noqa: BLE001 - reported to the parent process
        conn.send(("error", traceback.format_exc()))


def prefill_process(config: LoadConfig, ports: list[int], conn) -> None:
    """The prefill: compute each arrival's chunks on the stand-in clock and send what is ready."""
    try:
        # a row for every request the decodes can hold at once: it takes one once the request's lists are there
        device, pools, staging, engine = _side(config, "load-prefill", config.rows * config.decodes)
        endpoint = PrefillEndpoint(pools.side, engine, [ControlChannel(p, host=config.host) for p in ports], staging)
        endpoint.accept(timeout=config.timeout + 60)
        if config.warm_up:
            endpoint.warm_up(WARM_TRANSFERS, config.prompt_max, timeout=config.timeout + 60)
        conn.send(("ready",))
        started = _go(conn, config.timeout + 120)
        profile = Profile("load-prefill").__enter__()
        arrivals = deque(schedule(config))
        live: dict[str, dict[str, Any]] = {}
        outcomes: dict[str, dict[str, Any]] = {}
        samples, next_sample = [], 0.0
        end = started + config.duration + config.timeout + 30
        grain = config.chunk_tokens
        waiting: dict[str, Arrival] = {}  # arrived; admitted (a row, its forward pass) once its decode published it
        caller = _CallerTime()  # the time this thread spends inside kvplan's calls
        submitted: dict[Any, tuple[list, dict[str, float]]] = {}  # handle -> its chunks, their requests' ready times
        while (arrivals or waiting or live) and time.monotonic() < end:
            now = time.monotonic() - started
            while arrivals and arrivals[0].at <= now:
                a = arrivals.popleft()
                waiting[a.request] = a
            with caller:
                endpoint.progress()  # (destination lists, aborts)
            for request, a in list(waiting.items()):
                peer = endpoint.peers[a.decode]
                if request in peer.lists and (got := pools.take(a.prompt_len)) is not None:
                    del waiting[request]
                    live[request] = {"arrival": a, "row": got[0], "pages": got[1], "next": a.prefix_len, "moving": 0,
                                     "taken": time.monotonic(),
                                     "ready_at": now + compute_s(config, a, min(grain, a.prompt_len - a.prefix_len))}
                elif peer.dropped or now > a.at + config.timeout:
                    del waiting[request]
                    outcomes[request] = {"state": "failed", "reason": "its decode never published it (gone?)"}
            while endpoint.refused:  # refused by its decode before it was published (its queue was full)
                _, request, reason = endpoint.refused.popleft()
                if request in waiting:
                    del waiting[request]
                    outcomes[request] = {"state": "failed", "reason": f"its decode refused it: {reason}"}
            for k, request, reason in endpoint.aborted:
                if request in live or request in waiting:
                    outcomes[request] = {"state": "failed", "reason": f"the decode aborted it: {reason}"}
                    waiting.pop(request, None)
            endpoint.aborted.clear()
            chunks, last_ready, spans = [], {}, []
            for request, r in live.items():
                a = r["arrival"]
                if request in outcomes or r["next"] >= a.prompt_len or r["ready_at"] > now \
                        or endpoint.in_flight() >= config.in_flight:
                    continue  # (with in_flight batches moving, what is ready waits for the next: one larger batch)
                if request not in endpoint.peers[a.decode].lists:  # aborted (read next turn), or its decode is gone
                    if endpoint.peers[a.decode].dropped:
                        outcomes[request] = {"state": "failed", "reason": "the decode side is gone: its lists were dropped"}
                    continue
                lo, hi, ready = r["next"], r["next"], r["ready_at"]
                while True:  # the chunks ready by now, as one span (or the first of them alone)
                    hi = min(hi + grain, a.prompt_len)
                    span_ready = ready
                    ready += compute_s(config, a, min(grain, a.prompt_len - hi))  # the next chunk's
                    if hi >= a.prompt_len or not config.merge_ready or ready > now:
                        break
                last = hi >= a.prompt_len
                try:
                    with caller:
                        chunks.append(endpoint.transfer(Chunk(request, r["row"], lo, a.prompt_len + 1 if last else hi,
                                                              a.prompt_len, last, r["row"]), peer=a.decode))
                except InputError:  # its lists were dropped just now (an abort read on the progress thread): below
                    continue
                spans.append((a, r["row"], lo, hi))
                if last:
                    pools.aux[r["row"]] = a.index % 251 + 1
                    last_ready[request] = started + span_ready
                    r["last_submitted"] = time.monotonic()
                r["next"] = hi
                r["moving"] += 1
                r["ready_at"] = ready
            pools.write_many(spans)  # the stand-in forward pass of the turn's chunks, one write
            if chunks:  # (the stand-in forward pass's writes are ordered before it: submit waits for this stream)
                with caller:
                    submitted[endpoint.submit(chunks, mode=config.mode, timeout=config.timeout)] = (chunks, last_ready)
            with caller:
                ended = endpoint.completed()
            for handle in ended:
                sent, ready = submitted.pop(handle)
                try:
                    results = handle.result(timeout=0)
                except KvplanError as err:  # a batch that does not plan is refused whole (PrefillEndpoint.send)
                    results = {t.request: f"{type(err).__name__}: {err}" for t in sent}
                for t in sent:
                    live[t.request]["moving"] -= 1
                    reason = results.get(t.request)
                    if reason is not None and t.request not in outcomes:
                        outcomes[t.request] = {"state": "failed", "reason": reason}
                    elif t.last and reason is None:
                        r = live[t.request]
                        outcomes[t.request] = {"state": "sent", "ready": ready[t.request], "taken": r["taken"],
                                               "submitted": r["last_submitted"], "ended": time.monotonic()}
            for request in [r for r, x in live.items() if r in outcomes and not x["moving"]]:
                r = live.pop(request)
                pools.give(r["row"], r["pages"])
                with caller:
                    endpoint.forget([request], peer=r["arrival"].decode)
            if now >= next_sample:
                samples.append(_resources(engine, endpoint, started))
                conn.send(("progress", endpoint.stats()))
                next_sample = now + config.sample_s
            if not chunks and not ended:
                time.sleep(0.0005)  # (the stand-in clock: nothing is ready for a while)
        profile.__exit__(None, None, None)
        endpoint.close()
        samples.append(_resources(engine, endpoint, started))
        conn.send(("progress", {**endpoint.stats(), "caller_s": caller.seconds}))
        conn.send(("result", outcomes, samples, len(live) + len(arrivals) + len(waiting) + len(submitted)))
        conn.poll(60)
        engine.close()
    except Exception:  # noqa: BLE001 - reported to the parent process
        conn.send(("error", traceback.format_exc()))


@dataclass
class LoadReport:
    """What a load run measured (see the module docstring)."""

    config: LoadConfig
    requests: int = 0
    completed: int = 0
    verified: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # by cause
    unexpected: dict[str, int] = field(default_factory=dict)  # failures that no injected fault explains, by cause
    faults: dict[str, int] = field(default_factory=dict)  # injected, by kind
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)  # per process, its endpoint's counters at the end
    latency_ms: dict[str, float] = field(default_factory=dict)  # p50, p99: last chunk ready -> decode complete
    phases_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # where a completed request's time went (PHASES)
    throughput: dict[str, float] = field(default_factory=dict)
    quarantined: int = 0
    unsettled: int = 0
    with_killed_decode: int = 0  # requests of the decode killed mid-run (their outcome died with it)
    resources: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # per process, samples over time
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def caller_us_per_request(self) -> dict[str, float]:
        """Per process, the microseconds its caller's thread spent inside kvplan's calls, per request it
        handled (the prefill: every request it sent or failed; a decode: every request that ended there)."""
        out = {}
        for who, snap in self.stats.items():
            handled = sum(snap["requests"].values())
            if "caller_s" in snap and handled:
                out[who] = round(snap["caller_s"] / handled * 1e6, 1)
        return out

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["config"] = asdict(self.config)
        out["caller_us_per_request"] = self.caller_us_per_request()
        return out

    def lines(self) -> list[str]:
        c = self.config
        failed = sum(self.failures.values())
        unexpected = sum(self.unexpected.values())
        refused = self.failures.get("overload", 0)
        injected = {k: v for k, v in self.failures.items() if k != "overload"}
        for cause, count in self.unexpected.items():
            injected[cause] -= count
        parts = ([f"{refused} refused at admission as overload (nothing written)"] if refused else []) \
            + ([f"{sum(injected.values())} injected ({_counts({k: v for k, v in injected.items() if v})})"]
               if sum(injected.values()) else []) \
            + ([f"{unexpected} NOT injected ({_counts(self.unexpected)})"] if unexpected else [])
        failures = f"{failed}: " + "; ".join(parts) if failed else "none"
        cpu = c.resolved_device() == "cpu"
        out = [f"load          {self.requests} requests at {c.rate:g}/s for {c.duration:g} s, {c.decodes} decodes, "
               f"{c.engine}, mode {c.mode}, {c.resolved_device()}",
               f"completed     {self.completed} ({self.verified} byte-equal)"
               + (f"; {self.with_killed_decode} went to the decode killed mid-run" if self.with_killed_decode else ""),
               "injected      " + (_counts(self.faults) + " (faults on the schedule: each must fail its request)"
                                   if self.faults else "no faults"),
               f"failed        {failures}",
               f"throughput    {self.throughput.get('requests_per_s', 0):.1f} requests/s completed over "
               f"{self.throughput.get('span_s', 0):.1f} s (offered {self.throughput.get('offered_per_s', 0):.1f}/s), "
               f"{self.throughput.get('gib_per_s', 0):.3f} GiB/s"
               + (" (CPU, Triton interpreter: not a speed measurement)" if cpu else ""),
               f"latency       p50 {self.latency_ms.get('p50', float('nan')):.2f} ms, "
               f"p99 {self.latency_ms.get('p99', float('nan')):.2f} ms (last chunk ready -> decode complete)"]
        if self.phases_ms:
            out.append("phases        " + ", ".join(f"{name} p50 {v['p50']:.1f} p99 {v['p99']:.1f} ms"
                                                    for name, v in self.phases_ms.items()))
        caller = self.caller_us_per_request()
        if caller:
            order = sorted(caller.items(), key=lambda item: (item[0] != "prefill", item[0]))
            out.append("caller thread " + ", ".join(f"{who} {us:,.0f} us" for who, us in order)
                       + " per request (inside kvplan's calls" + (", the send's wait included" if "prefill" in caller
                                                                   else "") + ")")
        for who, samples in self.resources.items():
            if samples:
                a, b = samples[min(1, len(samples) - 1)], samples[-1]
                out.append(f"{who:<13} rss {a['rss_kib'] >> 10}->{b['rss_kib'] >> 10} MiB, fds {a['fds']}->{b['fds']}, "
                           f"sockets {a['sockets']}->{b['sockets']}, engine regions {a.get('engine_regions')}->"
                           f"{b.get('engine_regions')}, handles {a.get('engine_handles')}->{b.get('engine_handles')}")
        out.append("result        " + ("OK" if self.ok else "PROBLEMS: " + "; ".join(self.problems)))
        return out


PHASES = {  # a completed request's life, each phase (start, end) on the host's one monotonic clock
    "published->taken": ("published", "taken"),  # the decode's publish until the prefill had its lists and a row
    "taken->last submitted": ("taken", "submitted"),  # its earlier chunks' batches, and waits for a batch slot
    "last submitted->sent": ("submitted", "ended"),  # its last chunk's batch, submit to the prefill reading it ended
    "last submitted->complete": ("submitted", "at"),  # ... to the decode's poll returning it complete
}


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


# the load report's names for kvplan's causes of failure (kvplan.transport.stats.cause_of)
_CAUSE_NAMES = {"aborted": "abort", "peer gone": "decode gone"}


def _cause(reason: str) -> str:
    cause = cause_of(reason)
    return _CAUSE_NAMES.get(cause, cause)


def run_load(config: LoadConfig, progress: bool = False, metrics_port: int | None = None) -> LoadReport:
    """Run the processes to the end and report; problems (a byte that differs, a failure that was not
    injected, a table that did not drain, growth) are listed in ``problems``.

    ``progress``: a line on standard error, refreshed as the decodes report. ``metrics_port``: serve
    every endpoint's counters (:meth:`~kvplan.transport.decode.DecodeEndpoint.stats`) in Prometheus'
    text format on ``config.host`` at that port while the run lasts (:mod:`kvplan.transport.metrics`)."""
    if config.kill_at and config.decodes < 2:
        raise ValueError("kill_at needs at least two decodes: the killed one's peers must go on")
    if config.chunk_tokens % config.page_size or config.chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be a positive multiple of the page size {config.page_size}")
    wait = config.duration + config.timeout + 120
    procs: list[tuple[Any, Any, str]] = []  # (process, pipe, who)
    try:
        for k in range(config.decodes):
            mine, there = child_pipe()
            procs.append((start_child(decode_process, config, k, there), mine, f"decode {k}"))
        ports = [child_message(conn, who, wait)[1] for _, conn, who in procs]
        mine, there = child_pipe()
        procs.append((start_child(prefill_process, config, ports, there), mine, "prefill"))
        for _, conn, who in procs:
            child_message(conn, who, wait)  # ready: registered and paired
        started = time.monotonic() + 0.1
        for _, conn, _ in procs:
            conn.send(("go", started))
        return _collect(config, procs, started, wait, _Live(config, progress, metrics_port))
    finally:
        for proc, conn, _ in procs:
            try:
                conn.send("bye")
            except (BrokenPipeError, OSError):
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


class _Live:
    """What the processes report while the run goes: each endpoint's latest counters, shown as a
    progress line and served as metrics where asked."""

    def __init__(self, config: LoadConfig, progress: bool, metrics_port: int | None):
        self.config, self.progress = config, progress
        self.stats: dict[str, dict[str, Any]] = {}
        self.server = None
        self._shown = 0.0
        if metrics_port is not None:
            from ..transport.metrics import serve

            self.server = serve(lambda: [{**snap, "endpoint": who} for who, snap in list(self.stats.items())],
                                config.host, metrics_port)
            sys.stderr.write(f"kvplan load: metrics on http://{config.host}:{self.server.port}/metrics\n")

    def update(self, who: str, snap: dict[str, Any], started: float) -> None:
        self.stats[who] = snap
        now = time.monotonic()
        if self.progress and now - self._shown >= 0.25:
            self._shown = now
            decodes = [s for w, s in self.stats.items() if w != "prefill"]
            done = sum(s["requests"].get("complete", 0) for s in decodes)
            failed = sum(s["requests"].get("failed", 0) for s in decodes)
            flight = sum(s["in_flight"] for s in decodes)
            at = now - started
            when = (f"{max(at, 0.0):4.1f} of {self.config.duration:g} s of arrivals" if at < self.config.duration
                    else f"arrivals over, draining ({at:.1f} s)")
            sys.stderr.write(f"\r[load] {when}: {done} completed, {failed} failed (injected faults included), "
                             f"{flight} in flight   ")
            sys.stderr.flush()

    def close(self) -> None:
        if self.progress:
            sys.stderr.write("\n")
        if self.server is not None:
            self.server.close()


def _collect(config: LoadConfig, procs: list[tuple[Any, Any, str]], started: float, wait: float,
             live: _Live) -> LoadReport:
    """Every process's results (killing the last decode at ``kill_at``), then the report."""
    arrivals = {a.request: a for a in schedule(config)}
    report = LoadReport(config, requests=len(arrivals))
    killed = procs[config.decodes - 1][2] if config.kill_at else None
    results: dict[str, tuple] = {}
    deadline = time.monotonic() + wait
    try:
        while len(results) < len(procs) and time.monotonic() < deadline:
            if killed and time.monotonic() >= started + config.kill_at and killed not in results:
                proc = procs[config.decodes - 1][0]
                proc.kill()
                proc.join(5)
                results[killed] = ("killed",)
                live.stats.pop(killed, None)
                log.warning("load: killed %s at %.1f s", killed, config.kill_at)
            for _, conn, who in procs:
                if who not in results and conn.poll(0.01):
                    msg = child_message(conn, who, 1)
                    if msg[0] == "progress":
                        live.update(who, msg[1], started)
                    else:
                        results[who] = msg
    finally:
        live.close()
    report.stats = dict(live.stats)
    missing = [who for _, _, who in procs if who not in results]
    if missing:
        raise TimeoutError(f"no result from {missing} within {wait:.0f} s")
    sent = results["prefill"][1]
    report.resources["prefill"] = results["prefill"][2]
    report.unsettled = results["prefill"][3]
    done: dict[str, dict[str, Any]] = {}
    for k in range(config.decodes):
        result = results[f"decode {k}"]
        if result[0] == "killed":
            continue
        _, outcomes, samples, quarantined, unsettled = result
        done.update(outcomes)
        report.resources[f"decode {k}"] = samples
        report.quarantined += quarantined
        report.unsettled += unsettled
    latencies, moved, phases = [], 0, {}
    for request, a in arrivals.items():
        if a.fault:
            report.faults[a.fault] = report.faults.get(a.fault, 0) + 1
        here, there = done.get(request), sent.get(request, {})
        if killed is not None and a.decode == config.decodes - 1:
            report.with_killed_decode += 1
            continue
        if here is not None and here["state"] == "complete":
            report.completed += 1
            report.verified += bool(here["ok"])
            if not here["ok"]:
                report.problems.append(f"request {request}: a byte differs from what its source wrote")
            if here.get("disagree"):
                report.problems.append(here["disagree"])
            if a.fault:
                report.problems.append(f"request {request}: its {a.fault} fault was not observed")
            if there.get("state") == "sent":
                latencies.append((here["at"] - there["ready"]) * 1e3)
                stamps = {**there, **here}
                for name, (start, end) in PHASES.items():
                    if stamps.get(start) is not None and stamps.get(end) is not None:
                        phases.setdefault(name, []).append((stamps[end] - stamps[start]) * 1e3)
            moved += (a.prompt_len - a.prefix_len) * 2 * config.layers * config.token_bytes
            continue
        reason = (here or {}).get("reason") or there.get("reason") or "no outcome"
        cause = _cause(reason)
        report.failures[cause] = report.failures.get(cause, 0) + 1
        if cause == "overload":  # refused at admission, before any page was written: the bound at work
            continue
        if cause != a.fault:
            report.unexpected[cause] = report.unexpected.get(cause, 0) + 1
            report.problems.append(f"request {request} failed without a fault of that kind ({a.fault}): {reason}")
    if latencies:
        report.latency_ms = {"p50": round(float(np.percentile(latencies, 50)), 3),
                             "p99": round(float(np.percentile(latencies, 99)), 3)}
    report.phases_ms = {name: {"p50": round(float(np.percentile(v, 50)), 3), "p99": round(float(np.percentile(v, 99)), 3)}
                        for name, v in phases.items()}
    # over the run as it went: from the start to the last completion (a run that cannot keep up takes longer
    # than its arrivals)
    ends = [o["at"] for o in done.values() if o["state"] == "complete"]
    span = max(max(ends, default=started) - started, config.duration, 1e-9)
    report.throughput = {"offered_per_s": round(len(arrivals) / config.duration, 2),
                         "requests_per_s": round(report.completed / span, 2), "span_s": round(span, 2),
                         "gib_per_s": round(moved / span / 2**30, 4)}
    _check_resources(report)
    return report


def _check_resources(report: LoadReport) -> None:
    """Tables drained, and nothing grew between the run's first sample and its last."""
    if report.unsettled:
        report.problems.append(f"{report.unsettled} requests never settled")
    if report.quarantined:
        report.problems.append(f"{report.quarantined} failed requests were never fenced (their pages stay out of use)")
    for who, samples in report.resources.items():
        if not samples:
            continue
        # against the run's first quarter (an engine connects and keeps its handles on first use)
        first = next((x for x in samples if x["t"] >= report.config.duration / 4), samples[0])
        last = samples[-1]
        left = {k: v for k, v in last.items() if k in _TABLES and v}
        if left:
            report.problems.append(f"{who}: its tables did not drain: {left}")
        for key in ("fds", "sockets", "engine_regions", "engine_handles"):
            # an engine may open connections and keep handles up to bounds it declares (Mooncake's TCP lanes
            # per peer; the handles NIXL keeps for reposting)
            allowed = 2 + last.get("engine_connections_max", 0) if key in ("fds", "sockets") else 0
            if key == "engine_handles":
                allowed = max(0, last.get("engine_handles_max", 0) - first[key])
            if key in last and last[key] > first[key] + allowed:
                report.problems.append(f"{who}: {key} grew from {first[key]} to {last[key]} (allowed: +{allowed})")


_TABLES = ("tracked", "published", "owners", "own_lists", "fences", "waves", "early_waves", "runs", "lists",
           "planning", "backlog")
