"""The two processes of ``kvplan demo``: :func:`decode_process` (pools, lists published, every byte
checked) and :func:`prefill_process` (the batch planned with kvplan and sent, behind a stand-in forward
pass where the demo streams), each reporting to the parent through its pipe.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from dataclasses import replace
from typing import Any

import torch

from .. import env
from ..errors import KvplanError
from .baseline import sglang_style_descs
from .bench import median_ms
from ..planner.device import eager
from ..planner.device.destinations import PreallocatedRequest
from ..planner.contract.batch import Attention, Batch, SideMemory
from ..planner.contract.state_kinds import rules_of
from ..planner.contract.pairing import Mode, pair_sides
from ..planner.reference.oracle import plan_reference
from .scenarios import materialize
from ..profiling import Profile
from ..transport.control import ControlChannel
from ..transport.endpoints import Chunk, DecodeEndpoint, PrefillEndpoint
from ..transport.engines import make_engine
from .forward import StandInForward
from .verify import AddressSpace, execute
from .demo_config import ENGINE_ENV, DemoConfig, is_loopback

__all__ = ["decode_process", "prefill_process", "source_pools"]

log = logging.getLogger(__name__)

def _child_setup(config: DemoConfig) -> None:
    """Engine settings and the parent's log level in a spawned process (UCX kept on the loopback
    device only where the demo runs on loopback)."""
    for key, value in ENGINE_ENV:
        if key != "UCX_NET_DEVICES" or is_loopback(config.host):
            os.environ.setdefault(key, value)
    level = env.get("KVPLAN_LOG_LEVEL")
    if level:
        logging.basicConfig(level=level, format="%(levelname)s %(processName)s %(message)s")


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
    except KvplanError as err:  # what kvplan names (a setting, a peer that cannot pair): one line
        conn.send(("failed", f"{type(err).__name__}: {err}"))
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
    except KvplanError as err:
        conn.send(("failed", f"{type(err).__name__}: {err}"))
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
