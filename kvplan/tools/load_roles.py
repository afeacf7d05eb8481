"""The two roles of ``kvplan load``, each run in its own process: :func:`decode_process` (pages taken,
published, checked, released once fenced) and :func:`prefill_process` (chunks written on schedule and
sent as they are ready), and what each reports of its resources.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import traceback
from collections import deque
from typing import Any

import torch

from ..errors import InputError, KvplanError
from ..planner.device.destinations import PreallocatedRequest
from ..transport.control import MAX_REFUSED, ControlChannel
from ..transport.endpoints import Chunk, DecodeEndpoint, PrefillEndpoint
from ..transport.engines import make_engine
from ..profiling import Profile
from .demo_config import is_loopback
from .load_config import Arrival, LoadConfig, compute_s, fault_at, schedule
from .load_pools import Checked, Pools

__all__ = ["decode_process", "prefill_process"]

log = logging.getLogger(__name__)

TURN_S = 0.02  # the longest a decode's turn waits for a request to end when nothing else is due
FENCE_LOOK_S = 0.002  # ... while a failed request's fence is awaited (fenced() is a read: looked at this often)
FENCE_WAIT_S = 10.0  # a failed request's pages wait this long for their fence, then stay out of use (counted)
WARM_TRANSFERS = 256  # the largest batch both sides' warm-up readies (a turn's batch is rarely larger)
CHECK_LOOK_S = 0.001  # ... while a turn's checks come back from the card (a look at an event, this often)
CHECK_AGAIN_EVERY = 16  # every n-th request's bytes are checked a second way too, entry by entry


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


def _side(config: LoadConfig, name: str, rows: int) -> tuple[str, Pools, torch.Tensor | None, Any]:
    """One process's device, pools of ``rows`` requests, staging buffer (on a GPU, for staged and auto)
    and engine."""
    _setup(config)
    device = config.resolved_device()
    staging = torch.zeros(config.staging_mib << 20, dtype=torch.uint8, device=device) \
        if device == "cuda" and config.mode in ("auto", "staged") else None
    engine = make_engine(config.engine, name, "VRAM" if device == "cuda" else "DRAM", **config.engine_settings())
    return device, Pools(config, device, rows), staging, engine


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
    """``with caller: endpoint.call(...)``: the wall time the caller's thread spends inside kvplan's calls; and,
    from when it is made, the process's CPU time (every thread's: the caller's and kvplan's progress threads)
    against the wall time, so that a process that is mostly asleep shows it (:meth:`totals`)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._cpu0, self._wall0 = time.process_time(), time.monotonic()
        self._threads0 = thread_cpu()
        self._turns: list[float] = []
        self._turn0 = 0.0

    def turn(self) -> None:
        """A turn of the caller's loop begins."""
        self._turn0 = time.perf_counter()

    def turned(self) -> None:
        """... and its work ends (what follows is its wait)."""
        self._turns.append(time.perf_counter() - self._turn0)

    def totals(self) -> dict[str, Any]:
        """What the run's report takes of this process: ``caller_s``, ``cpu_s``, ``wall_s``, and ``threads``:
        the CPU seconds of its threads over the run, by thread name (kvplan names its progress threads)."""
        by_name: dict[str, float] = {}
        for tid, (name, seconds) in thread_cpu().items():
            before = self._threads0.get(tid)
            by_name[name] = by_name.get(name, 0.0) + seconds - (before[1] if before and before[0] == name else 0.0)
        turns = sorted(self._turns)
        pick = (lambda q: round(turns[min(len(turns) - 1, int(q * len(turns)))] * 1e3, 3)) if turns else (lambda q: 0.0)
        return {"caller_s": self.seconds, "cpu_s": time.process_time() - self._cpu0,
                "wall_s": time.monotonic() - self._wall0, "threads": {k: round(v, 3) for k, v in by_name.items()},
                "turns": {"count": len(turns), "p50_ms": pick(0.5), "p99_ms": pick(0.99), "max_ms": pick(1.0),
                          "busy_s": round(sum(turns), 3)}}

    def __enter__(self) -> "_CallerTime":
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds += time.perf_counter() - self._t0


def thread_cpu() -> dict[int, tuple[str, float]]:
    """Each thread of this process: its name and the CPU seconds it has used (Linux's /proc; empty elsewhere)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime, stime
        except (OSError, ValueError, IndexError):
            continue
    return out


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
        checking: deque[tuple[Checked, list[tuple[Arrival, int]], list[Arrival]]] = deque()  # turns' checks, in order
        outcomes: dict[str, dict[str, Any]] = {}
        samples, quarantined, next_sample = [], 0, 0.0
        caller = _CallerTime()  # the time this thread spends inside kvplan's calls
        bound = config.queue or config.rows
        end = started + config.duration + config.timeout + 30
        while (arrivals or live) and time.monotonic() < end:
            caller.turn()
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
            pools.flush()  # (the due rows' token-table entries, one copy queued before the publish reads them)
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
            # the turn's completed requests checked on the device together (a sample a second way too); the
            # answers are read, and the rows given back, on a later turn once they are on the host
            if complete:
                again = [(a, row) for a, row in complete if a.index % CHECK_AGAIN_EVERY == 0]
                checking.append((pools.check_later(complete, again), complete, [a for a, _ in again]))
            while checking and checking[0][0].ready():
                checked, complete_then, again_then = checking.popleft()
                oks, oks_again = checked.results()
                ok_of = {a.request: ok for (a, _), ok in zip(complete_then, oks)}
                for a, ok in zip(again_then, oks_again):
                    if ok != ok_of[a.request]:
                        outcomes[a.request]["disagree"] = f"request {a.request}: the two checks of its bytes disagree"
                for (a, row), ok in zip(complete_then, oks):
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
            caller.turned()
            endpoint.wait_ended(min(until_next if until_next > 0 else TURN_S, FENCE_LOOK_S if unfenced else TURN_S,
                                    CHECK_LOOK_S if checking else TURN_S))
        profile.__exit__(None, None, None)
        totals = caller.totals()  # (before close: its progress thread's CPU is read while it runs)
        endpoint.close()
        endpoint.log_trace()  # (KVPLAN_TRACE: each wave's steps here, logged once the run's timing is taken)
        samples.append(_resources(engine, endpoint, started))
        conn.send(("progress", {**endpoint.stats(), **totals}))
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
            caller.turn()
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
            caller.turned()
            if not chunks and not ended:
                time.sleep(0.0005)  # (the stand-in clock: nothing is ready for a while)
        profile.__exit__(None, None, None)
        totals = caller.totals()  # (before close: its progress thread's CPU is read while it runs)
        endpoint.close()
        samples.append(_resources(engine, endpoint, started))
        conn.send(("progress", {**endpoint.stats(), **totals}))
        conn.send(("result", outcomes, samples, len(live) + len(arrivals) + len(waiting) + len(submitted)))
        conn.poll(60)
        engine.close()
    except Exception:  # noqa: BLE001 - reported to the parent process
        conn.send(("error", traceback.format_exc()))
