"""One rank of an SGLang prefill or decode node, driven by SGLang 0.5.23's own scheduler-side code.

Run by ``test_sglang_scheduler_queues.py``, one process per rank (``python -m
tests.integrations.sglang_scheduler_node ROLE ...``). Each process is what SGLang's scheduler process
is to a transfer backend: its runtime configuration published, the plugins loaded with
``KVPLAN_SGLANG=1``, the attention-TP ranks of its side in one gloo group (SGLang's
``attn_tp_group.cpu_group``, over which its queues all-reduce their polls), SGLang's own
``ReqToTokenPool`` (``DecodeReqToTokenPool`` on decode), ``MHATokenToKVPool`` and
``PagedTokenToKVPoolAllocator`` on the CPU, SGLang's ``UnifiedRadixCache``, ``MetadataBuffers``,
real ``Req`` objects, and SGLang's queues and scheduler mixins:

* prefill: ``PrefillBootstrapQueue.add`` / ``pop_bootstrapped``, the mixin's ``send_kv_chunk`` (every
  chunk of a chunked prefill) and ``process_disagg_prefill_inflight_queue``;
* decode: ``DecodePreallocQueue.add`` / ``pop_preallocated`` (its radix cache gives prefix hits from
  earlier requests), ``DecodeTransferQueue.pop_transferred``; finished requests go back into the
  tree with SGLang's ``release_kv_cache``;
* aborts as SGLang's ``Scheduler.abort_request`` makes them (``kv_receiver.abort()`` on a request of
  the transfer queue; its module imports SGLang's HTTP server stack, which the CPU install lacks).

What stands in: the forward pass (it allocates a chunk's KV with SGLang's allocator and writes
``kv_value`` of every token, head and layer into SGLang's pool) and the scheduler's batch
bookkeeping. The stand-in scheduler object has exactly the attributes SGLang's code reads of it.

Each rank prints one JSON line: per request, ``"ok"``, ``"failed"`` or what went wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from array import array

import numpy as np

from tests.integrations.durations import step_stats

PAGE, CHUNK, LAYERS, TOTAL_HEADS, HEAD_DIM = 4, 16, 2, 4, 8  # the model's shape: --layers, --heads, --head-dim
DEVICE = "cpu"  # where SGLang's pools live: --device
POOL_TOKENS, ROWS, CONTEXT = 2048, 48, 256
WAVE = 16  # requests per wave; the second wave shares prefixes with the first
WINDOW = 12  # the SWA layer's window (tokens), with --swa


def plan(seed: int, waves: int, aborts: int):
    """Every request of the run, the same on every rank: ``(rid, room, prompt, wave, aborted)``.
    Half of each later wave's prompts continue a first-wave prompt (a decode-side prefix hit); in the
    last wave, ``aborts`` requests of three chunks or more are aborted by the decode mid-transfer."""
    rng = np.random.default_rng(seed)
    out = []
    for wave in range(waves):
        for k in range(WAVE):
            aborted = wave == waves - 1 and k % 4 == 3 and k // 4 < aborts
            n = int(rng.integers(2 * CHUNK + 1, 61)) if aborted else int(rng.integers(5, 61))
            prompt = [int(t) for t in rng.integers(1, 30000, n)]
            if wave and k % 2 == 0:
                base = out[k][2]
                keep = min(len(base), int(rng.integers(PAGE + 1, 40)))
                prompt = base[:keep] + prompt[: max(3, n - keep)]
            out.append((f"req-{wave}-{k}", 1000 + wave * WAVE + k, prompt, wave, aborted))
    return out


def kv_value(tokens, positions, layer: int, kv: int, heads) -> np.ndarray:
    """What the stand-in forward writes: an int16 per (token, head, dim), from the token, its
    position, the layer, K or V and the global head only (equal prefixes give equal KV)."""
    t = np.asarray(tokens, np.int64)[:, None, None]
    p = np.asarray(positions, np.int64)[:, None, None]
    h = np.asarray(heads, np.int64)[None, :, None]
    d = np.arange(HEAD_DIM, dtype=np.int64)[None, None, :]
    return ((t * 37 + p * 101 + layer * 7 + kv * 3 + h * 13 + d) % 16000 + 1).astype(np.int16)


def first_token(prompt) -> int:
    return (sum(prompt) * 7 + len(prompt)) % 30000 + 1


def publish(args, role: str):
    from sglang.srt import runtime_context as ctx

    server_args = ctx.get_context().override_server_args(
        disaggregation_mode=role, disaggregation_transfer_backend=args.backend,
        disaggregation_bootstrap_port=args.bootstrap_port, host="127.0.0.1", page_size=PAGE, device=DEVICE,
        tp_size=args.tp, max_running_requests=ROWS, context_length=CONTEXT, chunked_prefill_size=CHUNK,
        disaggregation_decode_enable_radix_cache=role == "decode" and not args.mamba).install()
    # SGLang's Mamba tree component reads its chunk size off the model's HF config unless it is seeded
    # (as SGLang's own fixtures do for a model without one)
    server_args._mamba_cache_chunk_size = 64
    ctx.get_parallel().override_permanently(
        tp_rank=args.rank, pp_rank=0, dp_rank=0, attn_tp_rank=args.rank, attn_cp_rank=0, attn_dcp_rank=0,
        attn_dp_rank=0, pp_group=None)
    if DEVICE != "cpu":  # the card SGLang's launcher would have assigned this rank (NIXL's backend sets it)
        ctx.get_device()._set("gpu_id", 0)
    return server_args


def own_backend(backend: str) -> None:
    """Without kvplan (``KVPLAN_SGLANG`` unset) SGLang's own backend runs: what SGLang's scheduler would
    have set up for it first (Mooncake's transfer engine, over TCP on loopback; NIXL's module under the
    name SGLang imports)."""
    if os.environ.get("KVPLAN_SGLANG") == "1":
        return
    if backend == "mooncake":
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import init_mooncake_transfer_engine

        init_mooncake_transfer_engine("127.0.0.1")
    else:
        from tests.integrations.sglang_sides import _nixl_as_sglang_imports_it

        _nixl_as_sglang_imports_it()


def gloo_group(args):
    """The side's attention-TP ranks in one gloo group, as SGLang's ``attn_tp_group.cpu_group``."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.dist_port}", world_size=args.tp,
                            rank=args.rank)
    return dist.group.WORLD


def pools(server_args, args, decode: bool):
    import torch
    from sglang.srt.disaggregation.decode import DecodeReqToTokenPool
    from sglang.srt.mem_cache import memory_pool
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    heads = TOTAL_HEADS // args.tp
    components = (ComponentType.FULL,)
    if args.swa:  # layer 0 full attention, layer 1 sliding-window (SGLang's SWA pool and allocator)
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        kv_pool = SWAKVPool(size=POOL_TOKENS, size_swa=POOL_TOKENS, page_size=PAGE, dtype=torch.bfloat16,
                            head_num=heads, head_dim=HEAD_DIM, swa_attention_layer_ids=[1],
                            full_attention_layer_ids=[0], device=DEVICE)
        allocator = SWATokenToKVPoolAllocator(POOL_TOKENS, POOL_TOKENS, PAGE, torch.bfloat16, DEVICE, kv_pool,
                                              need_sort=False)
        components = (ComponentType.FULL, ComponentType.SWA)
    else:
        kv_pool = memory_pool.MHATokenToKVPool(size=POOL_TOKENS, page_size=PAGE, dtype=torch.bfloat16,
                                               head_num=heads, head_dim=HEAD_DIM, layer_num=LAYERS, device=DEVICE,
                                               enable_memory_saver=False)
        allocator = PagedTokenToKVPoolAllocator(POOL_TOKENS, PAGE, torch.bfloat16, DEVICE, kv_pool, need_sort=False)
    if args.mamba:  # and a Mamba layer (model layer 2): SGLang's hybrid request pools, a state slot per request
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
        from sglang.srt.disaggregation.decode import HybridMambaDecodeReqToTokenPool

        shape = Mamba2StateShape.create(tp_world_size=args.tp, intermediate_size=16, n_groups=4, num_heads=4,
                                        head_dim=4, state_size=4, conv_kernel=4)
        mamba = dict(cache_params=Mamba2CacheParams(shape=shape, layers=[2]), mamba_layer_ids=[2],
                     enable_mamba_extra_buffer=False, enable_overlap_schedule=False, mamba_size=2 * ROWS)
        if decode:
            rows = HybridMambaDecodeReqToTokenPool(size=ROWS, max_context_len=CONTEXT, device=DEVICE,
                                                   enable_memory_saver=False, speculative_num_draft_tokens=None,
                                                   speculative_eagle_topk=None, pre_alloc_size=ROWS, **mamba)
        else:
            rows = memory_pool.HybridReqToTokenPool(size=ROWS, mamba_spec_state_size=ROWS, max_context_len=CONTEXT,
                                                    device=DEVICE, enable_memory_saver=False, **mamba)
        components += (ComponentType.MAMBA,)
    elif decode:
        rows = DecodeReqToTokenPool(size=ROWS, max_context_len=CONTEXT, device=DEVICE, enable_memory_saver=False,
                                    pre_alloc_size=ROWS)
    else:
        rows = memory_pool.ReqToTokenPool(size=ROWS, max_context_len=CONTEXT, device=DEVICE,
                                          enable_memory_saver=False)
    # the decode's radix cache gives its prefix hits; with Mamba it is off (SGLang caches a Mamba state
    # only at page size 1 or with its extra buffer)
    params = CacheInitParams(disable=not decode or args.mamba, req_to_token_pool=rows, token_to_kv_pool_allocator=allocator,
                             page_size=PAGE, tree_components=components,
                             sliding_window_size=WINDOW if args.swa else None)
    return kv_pool, allocator, rows, UnifiedRadixCache(params)


def head_range(args) -> range:
    heads = TOTAL_HEADS // args.tp
    return range(args.rank * heads, (args.rank + 1) * heads)


def layers(kv_pool, allocator) -> list:
    """Per layer: whether it is sliding-window, its K and V buffers (int16 views), and how a token
    slot of the request table maps to its slot there (SGLang's full-to-SWA translation)."""
    import torch

    if hasattr(kv_pool, "swa_kv_pool"):
        full, swa = kv_pool.full_kv_pool, kv_pool.swa_kv_pool
        return [(False, full.k_buffer[0].view(torch.int16), full.v_buffer[0].view(torch.int16), lambda locs: locs),
                (True, swa.k_buffer[0].view(torch.int16), swa.v_buffer[0].view(torch.int16),
                 allocator.translate_loc_from_full_to_swa)]
    return [(False, kv_pool.k_buffer[n].view(torch.int16), kv_pool.v_buffer[n].view(torch.int16), lambda locs: locs)
            for n in range(LAYERS)]


def write_kv(kv_pool, allocator, locs, tokens, positions, heads) -> None:
    import torch

    locs = torch.as_tensor(locs, dtype=torch.int64, device=DEVICE)
    for layer, (_, k, v, slots_of) in enumerate(layers(kv_pool, allocator)):
        slots = torch.as_tensor(slots_of(locs), dtype=torch.int64, device=DEVICE)
        for part, buffer in enumerate((k, v)):
            buffer[slots] = torch.from_numpy(kv_value(tokens, positions, layer, part, heads)).to(DEVICE)


def check_kv(kv_pool, allocator, locs, prompt, heads, window_from: int | None = 0) -> str | None:
    """Whether the KV at ``locs`` is the prompt's; a sliding-window layer from token ``window_from``
    on (None: not at all)."""
    import torch

    locs = torch.as_tensor(locs, dtype=torch.int64, device=DEVICE)
    for layer, (sliding, k, v, slots_of) in enumerate(layers(kv_pool, allocator)):
        lo = (window_from if sliding else 0)
        if lo is None or lo >= len(prompt):
            continue
        slots = torch.as_tensor(slots_of(locs[lo:]), dtype=torch.int64, device=DEVICE)
        for part, buffer in enumerate((k, v)):
            got = buffer[slots].cpu().numpy()
            want = kv_value(prompt[lo:], range(lo, len(prompt)), layer, part, heads)
            if (slots < 0).any() or not np.array_equal(got, want):
                bad = lo + np.nonzero((got != want).any(axis=(1, 2)) | (slots < 0).cpu().numpy())[0]
                return f"layer {layer} {'KV'[part]}: tokens {bad[:8].tolist()} of {len(prompt)} differ"
    return None


def mamba_items(rows, req) -> list:
    """The request's Mamba state in SGLang's pool: each state tensor's item (conv, temporal), as bytes."""
    import torch

    slot = int(rows.req_index_to_mamba_index_mapping[req.kv.req_pool_idx])
    cache = rows.mamba_pool.mamba_cache
    return [t[0, slot].view(torch.uint8).reshape(-1) for t in (*cache.conv, cache.temporal)]


def mamba_value(prompt, items, rank: int, tp: int) -> list:
    """What the stand-in forward leaves as the state after ``prompt``, per state tensor: this rank's
    slice of one model-wide byte pattern. SGLang slices a Mamba2 state tensor contiguously over the
    attention-TP ranks (no ``conv_shard_groups``), so rank ``r`` of ``tp`` holds bytes
    ``[r * n, (r + 1) * n)`` of the pattern, ``n`` its item length."""
    import torch

    seed = (sum(prompt) * 31 + len(prompt) * 7) % 1000
    out = []
    for k, item in enumerate(items):
        n = item.numel()
        pattern = (np.arange(n * tp, dtype=np.int64) * (3 + k) + seed) % 251 + 1
        out.append(torch.from_numpy(pattern[rank * n : (rank + 1) * n].astype(np.uint8)))
    return out


def new_req(rid: str, room: int, prompt, mode):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=4)
    params.normalize(None)
    return Req(rid, "", array("q", prompt), params, bootstrap_host="127.0.0.1", bootstrap_port=None,
               bootstrap_room=room, disagg_mode=mode)


class _Streamer:
    def stream_output(self, reqs, return_logprob, *rest) -> None:
        pass


def _scheduler_base(args, server_args, kv_pool, allocator, rows, tree, group):
    from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator
    import torch

    return dict(
        server_args=server_args, tp_rank=args.rank, tp_size=args.tp, random_seed=0,
        req_to_token_pool=rows, token_to_kv_pool_allocator=allocator, tree_cache=tree,
        attn_tp_cpu_group=group, attn_cp_cpu_group=group, tp_cpu_group=group,
        req_to_metadata_buffer_idx_allocator=ReqToMetadataIdxAllocator(ROWS),
        disagg_metadata_buffers=MetadataBuffers(size=ROWS, hidden_size=16, hidden_states_dtype=torch.float32,
                                                max_sampling_mask_tokens=0),
        output_streamer=_Streamer(), kv_checksum_computer=None, scheduler_stage_metrics=None, enable_overlap=False, enable_staging=False,
        spec_algorithm=types.SimpleNamespace(is_eagle=lambda: False, is_none=lambda: True),
        metrics_reporter=types.SimpleNamespace(enable_metrics=False, kv_transfer_latency_ms=0.0,
                                               kv_transfer_speed_gb_s=0.0),
        enable_hisparse=False, enable_lora=False, enable_priority_scheduling=False, enable_decode_hicache=False,
        kv_shard_widening=1, rust_server=None, waiting_queue=[], chunked_req=None, mm_receiver=None,
        dllm_config=None, grammar_manager=types.SimpleNamespace(abort_requests=lambda recv: None),
        model_config=types.SimpleNamespace(num_hidden_layers=LAYERS, get_total_num_kv_heads=lambda: TOTAL_HEADS,
                                           hf_text_config=types.SimpleNamespace()),
        sliding_window_size=WINDOW if args.swa else None,
        tp_worker=types.SimpleNamespace(
            is_hybrid_swa=args.swa,
            model_runner=types.SimpleNamespace(effective_logical_max_total_num_tokens=POOL_TOKENS,
                                               swa_max_total_num_tokens=POOL_TOKENS, kv_cache_dtype_str="auto")),
    )


def stand_in(mixin, attrs: dict):
    """An object of SGLang's scheduler mixin with exactly ``attrs``; anything else it is asked
    for raises, so the test names what SGLang's code reads."""
    cls = type("StandInScheduler", (mixin,), {})
    obj = cls.__new__(cls)
    obj.__dict__.update(attrs)
    return obj


def _aborted_by(req) -> bool:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return isinstance(req.finished_reason, FINISH_ABORT)


def run_prefill(args) -> dict:
    """SGLang's prefill scheduler: bootstrap queue, chunked prefill with a send per chunk, inflight queue."""
    from sglang.srt import runtime_context as ctx
    from sglang.srt.disaggregation import prefill, utils
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome
    from sglang.srt.plugins import load_plugins

    server_args = publish(args, "prefill")
    group = gloo_group(args)
    ctx.get_parallel().override_permanently(attn_tp_group=types.SimpleNamespace(cpu_group=group))
    load_plugins()
    own_backend(args.backend)
    backend = utils.TransferBackend(args.backend)
    server = None
    if args.rank == 0:
        server = utils.get_kv_class(backend, utils.KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", args.bootstrap_port)
    kv_pool, allocator, rows, tree = pools(server_args, args, decode=False)
    sched = stand_in(prefill.SchedulerDisaggregationPrefillMixin, {
        **_scheduler_base(args, server_args, kv_pool, allocator, rows, tree, group),
        "disaggregation_mode": utils.DisaggregationMode.PREFILL, "disagg_prefill_inflight_queue": [],
        "disagg_prefill_pending_chunk_rids": set(), "processed_tokens_counter": 0,
        # as Scheduler._release_aborted_request (SGLang's scheduler module does not import on the CPU
        # install): the tree cache concludes the request as aborted
        "_release_aborted_request": lambda req: tree.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)})
    queue = prefill.PrefillBootstrapQueue(
        kv_pool, None, sched.req_to_metadata_buffer_idx_allocator, sched.disagg_metadata_buffers, gpu_id=0,
        bootstrap_port=args.bootstrap_port, max_total_num_tokens=POOL_TOKENS, scheduler=sched,
        scheduler_stage_metrics=None, transfer_backend=backend)
    sched.disagg_prefill_bootstrap_queue = queue
    heads = head_range(args)
    planned = plan(args.seed, args.waves, args.aborts)
    reqs = {rid: new_req(rid, room, prompt, utils.DisaggregationMode.PREFILL) for rid, room, prompt, _, _ in planned}
    prompts = {rid: prompt for rid, _, prompt, _, _ in planned}
    to_abort = {rid for rid, *_, aborted in planned if aborted}
    for req in reqs.values():
        queue.add(req, num_kv_heads=len(heads))
    open(os.path.join(args.done_dir, f"prefill{args.rank}.ready"), "w").close()
    outcome, running, held = {}, [], []
    steps: list[float] = []  # per scheduler step, the seconds spent in SGLang's queue and send calls (the backend's)
    started = time.monotonic()
    deadline = started + args.deadline_s
    while len(outcome) < len(reqs):
        if time.monotonic() > deadline:
            outcome.update({rid: "hung" for rid in reqs if rid not in outcome})
            break
        waiting = {req.rid for req in queue.queue}
        began = time.perf_counter()
        popped = queue.pop_bootstrapped()
        step_s = time.perf_counter() - began
        running += popped
        gone = waiting - {req.rid for req in queue.queue} - {req.rid for req in popped}
        outcome.update({rid: "failed" for rid in gone})  # failed at bootstrap (SGLang's handle_bootstrap_failure)
        if held:  # an aborted request waits, mid-transfer, for its decode's abort notice
            polls = utils.poll_and_all_reduce([req.disagg_kv_sender for req in held], group)
            resumed = [req for req, poll in zip(held, polls) if poll == utils.KVPoll.Failed]
            held = [req for req in held if req not in resumed]
            running += resumed
        for req in list(running):
            _forward_chunk(req, prompts[req.rid], rows, allocator, kv_pool, heads)
            began = time.perf_counter()
            if req.extend_end < len(req.origin_input_ids):
                sched.send_kv_chunk(req)  # SGLang's process_prefill_chunk for its chunked_req
                step_s += time.perf_counter() - began
                if req.rid in to_abort and req.rid not in {r.rid for r in held} and req.extend_end == CHUNK:
                    running.remove(req)
                    held.append(req)
                continue
            running.remove(req)
            req.output_ids.append(first_token(prompts[req.rid]))  # SGLang's process_batch_result_disagg_prefill
            sched.disagg_prefill_inflight_queue.append(req)
            sched.send_kv_chunk(req, last_chunk=True)
            step_s += time.perf_counter() - began
        began = time.perf_counter()
        for req in sched.process_disagg_prefill_inflight_queue():
            outcome[req.rid] = "failed" if _aborted_by(req) else "ok"
        steps.append(step_s + time.perf_counter() - began)
        time.sleep(0.002)
    took_s = time.monotonic() - started
    # a serving prefill stays up: it goes on answering (aborts' acknowledgements) until the decode is done
    done = [os.path.join(args.done_dir, f"decode{rank}.done") for rank in range(args.peer_tp)]
    while not all(os.path.exists(path) for path in done) and time.monotonic() < deadline + 30:
        if hasattr(queue.kv_manager, "progress"):  # kvplan's manager answers on its poll; SGLang's on threads
            queue.kv_manager.progress()
        time.sleep(0.005)
    if hasattr(queue.kv_manager, "close"):  # kvplan's manager; SGLang's own end with the process
        queue.kv_manager.close()
    if server is not None:
        server.close()
    return {"outcome": outcome, "steps": step_stats(steps), "took_s": took_s}


def _forward_chunk(req, prompt, rows, allocator, kv_pool, heads) -> None:
    """The stand-in forward pass of one prefill chunk: a request row and the chunk's KV pages from
    SGLang's pools (its ``alloc_extend``), then the chunk's KV written into SGLang's KV pool."""
    import torch

    if not req.kv.holds_kv:
        rows.alloc([req])
    start = req.kv.kv_allocated_len
    end = min(start + CHUNK, len(prompt))
    row = req.kv.req_pool_idx
    last = int(rows.req_to_token[row, start - 1]) if start else -1
    locs = allocator.alloc_extend(torch.tensor([start], device=DEVICE), torch.tensor([start]),
                                  torch.tensor([end], device=DEVICE), torch.tensor([end]),
                                  torch.tensor([last], device=DEVICE), end - start)
    rows.req_to_token[row, start:end] = locs.to(torch.int32)
    write_kv(kv_pool, allocator, locs, prompt[start:end], range(start, end), heads)
    if end == len(prompt) and hasattr(rows, "mamba_pool"):  # the Mamba layer's state after the prompt
        items = mamba_items(rows, req)
        for item, value in zip(items, mamba_value(prompt, items, heads.start // len(heads), TOTAL_HEADS // len(heads))):
            item.copy_(value)
    req.kv.kv_allocated_len = req.kv.kv_committed_len = end
    req.extend_end = end


def run_decode(args) -> dict:
    """SGLang's decode scheduler: ``process_decode_queue`` (prealloc queue with radix-cache prefix hits,
    transfer queue, held releases of failed requests), aborts mid-transfer; then every completed
    request's KV is read back through the radix tree (a late write into a released page shows there)."""
    from sglang.srt import runtime_context as ctx
    from sglang.srt.disaggregation import decode, utils
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import match_kv_cache, release_kv_cache
    from sglang.srt.plugins import load_plugins

    server_args = publish(args, "decode")
    group = gloo_group(args)
    ctx.get_parallel().override_permanently(attn_tp_group=types.SimpleNamespace(cpu_group=group))
    load_plugins()
    own_backend(args.backend)
    backend = utils.TransferBackend(args.backend)
    kv_pool, allocator, rows, tree = pools(server_args, args, decode=True)
    sched = stand_in(decode.SchedulerDisaggregationDecodeMixin, {
        **_scheduler_base(args, server_args, kv_pool, allocator, rows, tree, group),
        "disaggregation_mode": utils.DisaggregationMode.DECODE, "running_batch": types.SimpleNamespace(reqs=[]),
        "collect_inflight_reqs": lambda: [], "last_batch": None, "new_token_ratio": 0.0,
        "batch_result_processor": types.SimpleNamespace(_maybe_update_reasoning_tokens=lambda req, token: None)})
    transfer = decode.DecodeTransferQueue(sched.req_to_metadata_buffer_idx_allocator, sched.disagg_metadata_buffers,
                                          sched, tree)
    prealloc = decode.DecodePreallocQueue(
        rows, allocator, None, sched.req_to_metadata_buffer_idx_allocator, sched.disagg_metadata_buffers, sched,
        transfer, tree, gpu_id=0, bootstrap_port=args.bootstrap_port, max_total_num_tokens=POOL_TOKENS,
        num_reserved_decode_tokens=8, transfer_backend=backend)
    sched.disagg_decode_prealloc_queue, sched.disagg_decode_transfer_queue = prealloc, transfer
    heads = head_range(args)
    planned = plan(args.seed, args.waves, args.aborts)
    outcome, prefix_hits, held, aborted, released = {}, {}, set(), {}, {}
    added, ready_s, kv_bytes = {}, [], 0  # when each request was added; added to decode-ready; KV bytes received
    token_bytes = LAYERS * 2 * len(heads) * HEAD_DIM * 2  # K and V of every layer, bf16
    steps: list[float] = []  # per scheduler step, the seconds of SGLang's process_decode_queue (the backend's calls)
    # the clock starts once every prefill rank has its queue (not while one is still importing SGLang)
    ready = [os.path.join(args.done_dir, f"prefill{rank}.ready") for rank in range(args.peer_tp)]
    until = time.monotonic() + args.deadline_s / 2
    while not all(os.path.exists(path) for path in ready) and time.monotonic() < until:
        time.sleep(0.01)
    started = time.monotonic()
    deadline = started + args.deadline_s
    for wave in range(args.waves):
        reqs = {}
        for rid, room, prompt, w, _ in planned:
            if w == wave:
                reqs[rid] = new_req(rid, room, prompt, utils.DisaggregationMode.DECODE)
                reqs[rid].bootstrap_port = args.bootstrap_port
                added[rid] = time.monotonic()
                prealloc.add(reqs[rid])
        to_abort = {rid for rid, *_, aborted in planned if aborted and rid in reqs}
        while any(rid not in outcome for rid in reqs) or transfer.has_pending_deferred_releases():
            if time.monotonic() > deadline:
                outcome.update({rid: "hung" for rid in reqs if rid not in outcome})
                break
            for d in transfer.queue:  # the client goes away mid-transfer: what Scheduler.abort_request does
                prefix_hits[d.req.rid] = d.req.kv.cache_protected_len
                if d.req.rid in to_abort and d.req.rid not in aborted:  # its pages, to watch once released
                    aborted[d.req.rid] = rows.req_to_token[d.req.kv.req_pool_idx, : len(d.req.origin_input_ids)].clone()
                if d.req.rid in to_abort and _landed(d.req, rows, kv_pool, allocator, heads):
                    to_abort.discard(d.req.rid)
                    d.kv_receiver.abort()
            began = time.perf_counter()
            sched.process_decode_queue()  # SGLang's decode step: releases, prealloc, transfer
            steps.append(time.perf_counter() - began)
            held |= {d.req.rid for d, *_ in transfer._deferred_releases}
            for rid, locs in aborted.items():  # its pages as SGLang released them: nothing may change them now
                if rid not in released and not reqs[rid].kv.holds_kv:
                    released[rid] = (locs, _kv_bytes(kv_pool, allocator, locs))
            for req in sched.waiting_queue:
                ready_s.append(time.monotonic() - added[req.rid])
                kv_bytes += (len(req.origin_input_ids) - req.kv.cache_protected_len) * token_bytes
                outcome[req.rid] = _check(req, rows, kv_pool, allocator, heads)
                req.finished_reason = FINISH_LENGTH(length=0)  # it decodes, finishes, and its KV joins the tree
                release_kv_cache(req, tree, checkpoint=True)
            sched.waiting_queue.clear()
            queued = {d.req.rid for d in prealloc.queue} | {d.req.rid for d in transfer.queue}
            outcome.update({rid: "failed" for rid, req in reqs.items()
                            if rid not in outcome and rid not in queued and _aborted_by(req)})
            time.sleep(0.002)
    took_s = time.monotonic() - started
    time.sleep(0.5)  # anything still landing lands now
    swept = {}
    for rid, _, prompt, _, _ in planned:
        if outcome.get(rid) == "ok":
            probe = new_req(rid + "-probe", 0, prompt, utils.DisaggregationMode.DECODE)
            match_kv_cache(probe, tree, probe.origin_input_ids)
            locs = tree.prefix_device_indices(probe)
            swept[rid] = check_kv(kv_pool, allocator, locs, prompt[: len(locs)], heads, None) or len(locs)
    free = set(getattr(allocator, "full_attn_allocator", allocator).get_all_free_pages().tolist())
    late = {}  # per aborted request: (its released tokens still free, those written after their release)
    for rid, (locs, then) in released.items():
        still = np.array([int(loc) // PAGE in free for loc in locs.tolist()])
        changed = (_kv_bytes(kv_pool, allocator, locs) != then).reshape(len(locs), -1).any(axis=1)
        late[rid] = [int(still.sum()), int((changed & still).sum())]
    open(os.path.join(args.done_dir, f"decode{args.rank}.done"), "w").close()
    mirrored = getattr(prealloc.kv_manager, "aux_mirror", None) is not None  # (kvplan's: its aux rows' device copy)
    if hasattr(prealloc.kv_manager, "close"):
        prealloc.kv_manager.close()
    return {"outcome": outcome, "prefix_hits": prefix_hits, "held": sorted(held), "swept": swept, "late": late,
            "steps": step_stats(steps), "took_s": took_s, "ready": step_stats(ready_s), "kv_bytes": kv_bytes,
            "aux_mirror": mirrored}


def _kv_bytes(kv_pool, allocator, locs) -> np.ndarray:
    """The full-attention layers' K and V of the token slots ``locs``, as one int16 row per slot."""
    import torch

    at = torch.as_tensor(locs, dtype=torch.int64, device=DEVICE)
    return np.concatenate([b[at].reshape(len(at), -1).cpu().numpy() for sliding, k, v, _ in layers(kv_pool, allocator)
                           if not sliding for b in (k, v)], axis=1)


def _landed(req, rows, kv_pool, allocator, heads) -> bool:
    """Whether the first chunk's bytes are in the request's first page past its prefix (the slot
    holds it, not what an earlier request left): the prefill holds the rest until the abort reaches it."""
    at = req.kv.cache_protected_len
    loc = int(rows.req_to_token[req.kv.req_pool_idx, at])
    want = kv_value(req.origin_input_ids[at : at + 1], [at], 0, 0, heads)[0]
    return bool((layers(kv_pool, allocator)[0][1][loc].cpu().numpy() == want).all())


def _check(req, rows, kv_pool, allocator, heads) -> str:
    """The request's first token and KV: every full layer's token, a sliding-window layer's window
    (the prefill sends it past the decode's prefix; SGLang's decode keeps no SWA before it)."""
    prompt = list(req.origin_input_ids)
    if list(req.output_ids) != [first_token(prompt)]:
        return f"first token {list(req.output_ids)}"
    locs = rows.req_to_token[req.kv.req_pool_idx, : len(prompt)]
    window_from = max(len(prompt) - WINDOW, req.kv.cache_protected_len)
    if hasattr(rows, "mamba_pool"):
        items = mamba_items(rows, req)
        for k, (got, want) in enumerate(zip(items, mamba_value(prompt, items, heads.start // len(heads),
                                                               TOTAL_HEADS // len(heads)))):
            if not bool((got.cpu() == want).all()):
                return f"Mamba state tensor {k} differs"
    return check_kv(kv_pool, allocator, locs, prompt, heads, window_from) or "ok"


def main(argv=None) -> None:
    global DEVICE, LAYERS, TOTAL_HEADS, HEAD_DIM  # the run's shape, which every helper here reads
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("prefill", "decode"))
    parser.add_argument("--backend", default="nixl")
    parser.add_argument("--bootstrap-port", type=int, required=True)
    parser.add_argument("--dist-port", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--waves", type=int, default=2)
    parser.add_argument("--aborts", type=int, default=1)
    parser.add_argument("--deadline-s", type=float, default=120.0)
    parser.add_argument("--peer-tp", type=int, default=1, help="the other side's TP size")
    parser.add_argument("--done-dir", required=True, help="where each decode rank marks that it is done")
    parser.add_argument("--swa", action="store_true", help="layer 1 sliding-window (SGLang's SWA pool)")
    parser.add_argument("--mamba", action="store_true", help="and a Mamba layer (SGLang's hybrid request pools)")
    parser.add_argument("--device", default="cpu", help="where SGLang's pools live (cuda: on the GPU)")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--heads", type=int, default=TOTAL_HEADS, help="KV heads of the model, over all TP ranks")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
    args = parser.parse_args(argv)
    DEVICE, LAYERS, TOTAL_HEADS, HEAD_DIM = args.device, args.layers, args.heads, args.head_dim
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, root)
    from tests.sglang_real import _stand_ins

    _stand_ins()
    result = run_prefill(args) if args.role == "prefill" else run_decode(args)
    print(json.dumps(result), flush=True)


def run_child(argv: list[str], out_path: str, err_path: str) -> None:
    """:func:`main` in a child process of the tests (:func:`kvplan.tools.target_process.child_process`),
    its standard output and error written to the two files; it exits 0 when ``main`` returned, else 1."""
    import traceback

    code = 1
    with open(out_path, "w") as out, open(err_path, "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            main(argv)
            code = 0
        except BaseException:  # noqa: BLE001 - its traceback is the test's message
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # an engine's threads may still run: leave without waiting for them


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # SGLang's NIXL transfer workers are not daemon threads: leave without waiting for them
