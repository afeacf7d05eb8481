"""A prefill or a decode vLLM engine, reduced to what touches the connector, in a process of its own:
kvplan's connector built by vLLM's factory in both roles, KV caches
allocated by vLLM's own ``allocate_kv_cache``, and the engine loop's calls in vLLM's order
(``build_connector_meta``, ``bind_connector_metadata``, ``start_load_kv``, ``get_transfer_results``,
``get_block_ids_with_load_errors``, ``update_connector_output``).

The prefill fills each request's blocks with bytes drawn from the request's name, finishes the
requests, writes the parameters it returns (what vLLM's proxy hands the decode) to ``--params``, and
steps until every request is reported finished sending. The decode reads them, allocates its own
(scattered) blocks, steps until every request is reported finished receiving, and checks every byte
of every block it received. Each prints one JSON line of what it saw, or, started by the tests as
a child process (:func:`run` under :func:`tests.isolated.report_and_exit`), sends it back.

    python -m tests.integrations.vllm_node prefill --port 17500 --params /tmp/p.json --layout LBNHC
    python -m tests.integrations.vllm_node decode --params /tmp/p.json --layout LBNHC
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import zlib
from types import SimpleNamespace

from tests.integrations.durations import step_stats
from tests.integrations.vllm_fakes import (BLOCK, MAMBA_CONV, MAMBA_DTYPES, MAMBA_GROUPS, MAMBA_HEADS, full_attention,
                                           hybrid_attention, kv_blocks, kv_caches, mamba_hybrid,
                                           nixl_as_vllm_imports_it, nixl_vllm_config, request, vllm_config)

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
WINDOW_LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3, 6)]  # (a sliding-window group, --window)
MAMBA_LAYERS = [f"model.layers.{i}.mixer" for i in range(3, 6)]  # (a Mamba group, --mamba)
HEADS, HEAD_SIZE = 2, 16


def use_shape(layers: int, heads: int, head_size: int) -> None:
    """This process's model: ``layers`` full-attention layers of ``heads`` KV heads of ``head_size`` (a process
    runs one side: the benchmarks' larger shapes; the tests keep the defaults above)."""
    global LAYERS, HEADS, HEAD_SIZE
    LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    HEADS, HEAD_SIZE = heads, head_size


def block_bytes(request_name: str, index: int, layer: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes block ``index`` of a request holds in ``layer`` (both processes draw the same)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{request_name}/{index}/{layer}".encode()))
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


def state_bytes(request_name: str, layer: int, tp_size: int = 1, tp_rank: int = 0) -> torch.Tensor:
    """The bytes of a request's Mamba state in ``layer`` that TP rank ``tp_rank`` of ``tp_size`` holds (int8,
    as its page holds them): its part of the model's conv state, sub-projection by sub-projection, then of
    its temporal state, by head (both processes draw the model's whole state alike)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{request_name}/state/{layer}".encode()))
    conv = torch.randn(MAMBA_CONV, generator=gen).to(MAMBA_DTYPES[0])  # (rows, channels)
    temporal = torch.randn(MAMBA_HEADS, generator=gen).to(MAMBA_DTYPES[1])
    channels, start = [], 0
    for group in MAMBA_GROUPS:
        channels += range(start + tp_rank * group // tp_size, start + (tp_rank + 1) * group // tp_size)
        start += group
    heads = MAMBA_HEADS[0] // tp_size
    parts = conv[:, channels].contiguous(), temporal[tp_rank * heads : (tp_rank + 1) * heads].contiguous()
    return torch.cat([part.view(torch.int8).reshape(-1) for part in parts])


def token_bytes(request_name: str, token: int, layer: int, content: int, heads: slice) -> torch.Tensor:
    """The bytes of one token of a request in ``layer``, of the model's heads ``heads`` (a rank's), where
    the two sides' blocks or TP sizes differ: drawn for every head of the model, then sliced."""
    return block_bytes(request_name, -1 - token, layer, (HEADS, content))[heads]


def rank_heads(tp_size: int, tp_rank: int) -> slice:
    """The model's KV heads TP rank ``tp_rank`` of ``tp_size`` holds."""
    per_rank = HEADS // tp_size
    return slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)


def as_tp_rank(tp_size: int, tp_rank: int) -> None:
    """Make this process vLLM's TP rank ``tp_rank`` of ``tp_size``, as its parallel state would say."""
    if tp_size == 1:
        return
    from vllm.distributed import parallel_state

    parallel_state.model_parallel_is_initialized = lambda: True
    parallel_state.get_tensor_model_parallel_rank = lambda: tp_rank


def tokens_of(cache: torch.Tensor, blocks: list[int], count: int, block: int):
    """``(token, its view)`` of a request's first ``count`` tokens in one layer's cache (logically
    ``[blocks, heads, block_size, content]``)."""
    return ((t, cache[blocks[t // block], :, t % block, :]) for t in range(count))


def connectors(role: str, extra: dict, num_blocks: int, layout: KVCacheLayout, engine_id: str, block: int,
               tp_size: int = 1, tp_rank: int = 0, window: int = 0, mamba: bool = False, scratch: int = 0,
               window_block: int = 0, connector: str = "kvplan", model_dir: str = "", device: str = "cpu"):
    """Both roles' connectors over this side's KV caches, as vLLM's engine core and model runner build them:
    kvplan's (``extra``: its settings), or vLLM's own ``NixlConnector`` (``connector="nixl"``: its side
    channel at ``extra``'s host and port). The KV lives on ``device``."""
    if connector == "nixl":
        return nixl_connectors(role, extra, num_blocks, layout, engine_id, block, model_dir, device)
    as_tp_rank(tp_size, tp_rank)
    if mamba:  # a full-attention group and a Mamba group, overlaid as vLLM places them
        kv_cache = mamba_hybrid(LAYERS, MAMBA_LAYERS, num_blocks=num_blocks, heads=HEADS // tp_size, tp_size=tp_size,
                                head_size=HEAD_SIZE, layout=layout, block_size=block, scratch_blocks=scratch)
    elif window:  # a full-attention group and a sliding-window group, overlaid as vLLM places them
        kv_cache = hybrid_attention(LAYERS, WINDOW_LAYERS, window, num_blocks=num_blocks, heads=HEADS // tp_size,
                                    head_size=HEAD_SIZE, layout=layout, block_size=block, window_block_size=window_block)
    else:
        kv_cache = full_attention(LAYERS, num_blocks=num_blocks, heads=HEADS // tp_size, head_size=HEAD_SIZE,
                                  layout=layout, block_size=block)
    config = vllm_config(extra, role="kv_both", engine_id=engine_id, block_size=block, tp_size=tp_size)
    scheduler = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache)
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache)
    caches = kv_caches(kv_cache, layout, device)
    worker.register_kv_caches(caches)
    return scheduler, worker, caches


def nixl_connectors(role: str, extra: dict, num_blocks: int, layout: KVCacheLayout, engine_id: str, block: int,
                    model_dir: str, device: str = "cpu"):
    """vLLM's own ``NixlConnector`` in both roles (TP 1, full attention): the baseline. vLLM's distributed
    state of one rank, the side channel where ``extra`` says, and the handshake metadata handed from the
    worker to the scheduler as vLLM's engine core hands it after registration."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    from tests.ports import free_port

    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"], os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = extra["host"], str(extra["port"])
    nixl_as_vllm_imports_it()
    config = nixl_vllm_config(role, engine_id, model_dir, block, device=device)
    kv_cache = full_attention(LAYERS, num_blocks=num_blocks, heads=HEADS, head_size=HEAD_SIZE, layout=layout,
                              block_size=block)
    cores = os.sched_getaffinity(0)
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://{extra['host']}:{free_port()}")
        ensure_model_parallel_initialized(1, 1)
        scheduler = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache)
        worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache)
    # on a CPU vLLM's worker pins its process to one core per NUMA node (kept from its model's forward pass);
    # here there is no forward pass, and kvplan's side keeps every core: so does this one
    os.sched_setaffinity(0, cores)
    caches = kv_caches(kv_cache, layout, device)
    worker.register_kv_caches(caches)
    metadata = worker.get_handshake_metadata()
    if metadata is not None:
        scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): metadata})
    return scheduler, worker, caches


STATS: list = []  # this process's connector stats, aggregated step by step as vLLM's logger does
STEP_S: list[float] = []  # each step's time in the connector's calls (the engine's threads)


def step(scheduler, worker, finished: set[str]):
    """One engine step's connector calls, in vLLM's order; what the scheduler heard."""
    started = time.perf_counter()
    worker.bind_connector_metadata(scheduler.build_connector_meta(SimpleNamespace()))
    worker.start_load_kv(None)
    worker.wait_for_save()
    results = worker.get_transfer_results(finished)
    invalid = worker.get_block_ids_with_load_errors()
    stats = worker.get_kv_connector_stats()
    if stats is not None:  # (through the payload, as it crosses vLLM's processes)
        stats = type(worker).build_kv_connector_stats(json.loads(json.dumps(stats.data)))
        STATS[:] = [STATS[0].aggregate(stats) if STATS else stats]
    worker.clear_connector_metadata()
    scheduler.update_connector_output(SimpleNamespace(finished_sending=results.finished_sending,
                                                      finished_recving=results.finished_recving))
    STEP_S.append(time.perf_counter() - started)
    return results, invalid


def pool_size(args: argparse.Namespace, floor: int) -> int:
    """The blocks of this side's pool: ``floor`` (the tests' draws depend on it), or more where every request
    of ``--lengths`` needs more (block 0 is vLLM's null block)."""
    window = -(-max(args.lengths, default=0) // (args.window_block_size or args.block_size)) if args.window else 0
    state = 1 + args.scratch_blocks if args.mamba else 0
    return max(floor, 2 + sum(-(-n // args.block_size) + 1 + window + state for n in args.lengths))


def prefill(args: argparse.Namespace) -> dict:
    extra = {"host": "127.0.0.1", "port": args.port, "engine": args.engine, "timeout_s": args.timeout,
             "mode": args.mode, **({"max_requests": args.max_requests} if args.max_requests else {})}
    num_blocks = pool_size(args, 64)
    scheduler, worker, caches = connectors("prefill", extra, num_blocks, KVCacheLayout[args.layout], "prefill-engine",
                                           args.block_size, args.tp_size, args.tp_rank, args.window, args.mamba,
                                           args.scratch_blocks, args.window_block_size, args.connector,
                                           args.params + ".model", args.device)
    heads = rank_heads(args.tp_size, args.tp_rank)
    wbs = args.window_block_size or args.block_size
    rng = random.Random(1)
    free = list(range(1, num_blocks))  # (block 0 is vLLM's null block; the groups draw from one pool)
    rng.shuffle(free)
    params, names = [], []
    for i, prompt_len in enumerate(args.lengths):
        name = f"{args.names}{i}"
        finished = request(name, prompt_len, {"do_remote_decode": True})
        scheduler.on_new_request(finished)  # (with a Mamba group: the prompt's last token is left to the decode)
        prompt_len = finished.num_prompt_tokens
        count = -(-prompt_len // args.block_size)
        groups = [(LAYERS, [free.pop() for _ in range(count)])]
        if args.window:
            groups.append((WINDOW_LAYERS, [free.pop() for _ in range(-(-prompt_len // wbs))]))
        if args.mamba:  # its state block, then vLLM's speculative scratch blocks
            state_block = free.pop()
            groups.append((MAMBA_LAYERS, [state_block] + [free.pop() for _ in range(args.scratch_blocks)]))
            for layer_name in MAMBA_LAYERS:
                view = caches[layer_name][state_block]
                view.copy_(state_bytes(name, int(layer_name.split(".")[2]), args.tp_size, args.tp_rank).view(view.shape))
        for layer_names, blocks in groups:
            if layer_names is MAMBA_LAYERS:
                continue
            for layer_name in layer_names:
                layer = int(layer_name.split(".")[2])
                if args.by_token:
                    own_size = wbs if layer_names is WINDOW_LAYERS else args.block_size
                    for t, view in tokens_of(caches[layer_name], blocks, prompt_len, own_size):
                        view.copy_(token_bytes(name, t, layer, view.shape[-1], heads))
                    continue
                for j, b in enumerate(blocks):
                    caches[layer_name][b].copy_(block_bytes(name, j, layer, tuple(caches[layer_name][b].shape)))
        block_ids = tuple(blocks for _, blocks in groups)
        scheduler.get_num_new_matched_tokens(finished, 0)  # (what vLLM's scheduler asks of a new request)
        scheduler.update_state_after_alloc(finished, kv_blocks(*block_ids), 0)
        if args.window:  # vLLM frees the blocks before the window and hands the connector its null block there
            skipped = max(0, prompt_len - args.window + 1) // wbs
            block_ids[1][:skipped] = [0] * skipped
            if i == 0 and args.freed_window_block and skipped < len(block_ids[1]):  # (one freed inside the window)
                block_ids[1][skipped] = 0
        finished.num_computed_tokens, finished.status = prompt_len, RequestStatus.FINISHED_LENGTH_CAPPED
        keep, returned = scheduler.request_finished_all_groups(finished, block_ids)
        assert keep, name
        params.append(returned)
        names.append(name)
    if args.tp_rank == 0:  # (what vLLM's proxy hands the decode comes from one prefill rank)
        with open(args.params + ".tmp", "w") as f:
            json.dump(params, f)
        os.replace(args.params + ".tmp", args.params)
    if args.exit_early:  # gone before any decode reached it
        worker.shutdown()
        return {"sent": [], "freed": False}
    sent: set[str] = set()
    finished_now = set(names)  # (vLLM names them finished in the step after request_finished)
    deadline = time.monotonic() + args.timeout + 30
    while sent != set(names) and time.monotonic() < deadline:
        results, _ = step(scheduler, worker, finished_now)
        finished_now = set()
        sent |= results.finished_sending
        time.sleep(0.002)
    freed = not scheduler.has_pending_push_work()
    done = lambda: sum(os.path.exists(f"{args.params}.done{r}") for r in range(args.decode_ranks))  # noqa: E731
    while done() < args.decode_ranks and time.monotonic() < deadline:
        step(scheduler, worker, set())  # (answers the decode's aborts while it checks)
        time.sleep(0.01)
    worker.shutdown()
    return {"sent": sorted(sent), "freed": freed, "stats": STATS[0].reduce() if STATS else None,
            "step": step_stats(STEP_S)}


def decode(args: argparse.Namespace) -> dict:
    extra = {"host": "127.0.0.1", "port": args.port, "engine": args.engine, "timeout_s": args.timeout,
             **({"integrity": True} if args.integrity else {}),
             **({"max_requests": args.max_requests} if args.max_requests else {})}
    num_blocks = pool_size(args, 96)
    scheduler, worker, caches = connectors("decode", extra, num_blocks, KVCacheLayout[args.layout], "decode-engine",
                                           args.block_size, args.tp_size, args.tp_rank, args.window, args.mamba,
                                           args.scratch_blocks, args.window_block_size, args.connector,
                                           args.params + ".model", args.device)
    heads = rank_heads(args.tp_size, args.tp_rank)
    wbs = args.window_block_size or args.block_size
    rng = random.Random(2)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    mine = {}  # local id -> (prefill's name, blocks)
    admitted = {}  # local id -> when the scheduler handed it to the connector (perf_counter)
    states = {}  # local id -> its Mamba state block ([] without --mamba)
    received, failed, invalid = set(), set(), set()
    ready_s = {}  # local id -> seconds from admitted to reported received
    wrong, tokens_checked = [], 0
    pairing_after_first_step = None  # whether the first step returned while its handshake still ran
    all_params = []
    # a round per parameters file: the requests of one prefill process, all received and checked before the
    # next round's file is read (--then-params: that prefill may be a new process at the same address)
    for round_no, path in enumerate([args.params, *args.then_params]):
        deadline = time.monotonic() + 60
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the prefill wrote no parameters ({path})")
            time.sleep(0.05)
        with open(path) as f:
            params = json.load(f)
        if args.ghost and round_no == 0:  # a request its prefill never had: it must be reported failed, never complete
            params.append({**params[0], "remote_request_id": "p-req-ghost"})
        all_params += params
        this_round = []
        for i, p in enumerate(params):
            prompt_len = p["remote_num_tokens"]
            local = f"d-req-{i}" if round_no == 0 else f"d{round_no}-req-{i}"
            this_round.append(local)
            # (with a Mamba group the decode holds the whole prompt and loads all but its last token)
            # a prefix cache hit: whole blocks of the prompt already computed here, never all of it
            hit = min(args.prefix_hit, (prompt_len - 1) // args.block_size * args.block_size)
            r = request(local, prompt_len + (1 if args.mamba else 0), p, computed=hit)
            count, is_async = scheduler.get_num_new_matched_tokens(r, hit)
            assert is_async and count == prompt_len - hit, (count, is_async)
            blocks = [free.pop() for _ in range(-(-prompt_len // args.block_size))]
            for layer, layer_name in enumerate(LAYERS):  # (the hit's blocks hold what the prefix cache holds)
                for j, b in enumerate(blocks[: hit // args.block_size]):
                    view = caches[layer_name][b]
                    view.copy_(block_bytes(p["remote_request_id"], j, layer, tuple(view.shape)))
            # a sliding-window group's blocks as vLLM's scheduler allocates them: its null block (0) where a block
            # lies wholly before the window, its own blocks from there on
            skipped = max(0, count - args.window + 1) // wbs if args.window else 0
            window_blocks = ([0] * skipped + [free.pop() for _ in range(-(-count // wbs) - skipped)]) if args.window else []
            state_blocks = [free.pop() for _ in range(1 + args.scratch_blocks)] if args.mamba else []
            groups = [blocks] + ([window_blocks] if args.window else []) + ([state_blocks] if args.mamba else [])
            admitted[local] = time.perf_counter()
            scheduler.update_state_after_alloc(r, kv_blocks(*groups), count)
            mine[local] = (p["remote_request_id"], blocks, window_blocks)
            states[local] = state_blocks[:1]
        deadline = time.monotonic() + args.timeout + 30
        while not set(this_round) <= received and time.monotonic() < deadline:
            results, bad = step(scheduler, worker, set())
            now = time.perf_counter()
            if pairing_after_first_step is None and args.connector == "kvplan":
                pairing_after_first_step = any(not p.done() for p in worker.worker.links.pairings.values())
            ready_s.update((local, now - admitted[local]) for local in results.finished_recving - received)
            received |= results.finished_recving
            failed |= results.failed_recving
            invalid |= bad
            time.sleep(0.002)
        receiving_steps = list(STEP_S)  # (the steps until every request arrived; checking follows)
        for local in sorted(set(this_round) & received - failed):
            name, blocks, window_blocks = mine[local]
            for layer, layer_name in enumerate(LAYERS + (WINDOW_LAYERS if args.window else [])):
                if args.by_token:  # every token of the prompt (of the window), wherever this side's blocks put it
                    count = next(p["remote_num_tokens"] for p in all_params if p["remote_request_id"] == name)
                    own = blocks if layer_name in LAYERS else window_blocks
                    first = 0 if layer_name in LAYERS else max(0, count - args.window + 1)
                    for t, view in tokens_of(caches[layer_name], own, count,
                                             args.block_size if layer_name in LAYERS else wbs):
                        if t < first:
                            continue
                        tokens_checked += 1
                        if not torch.equal(view.cpu(), token_bytes(name, t, layer, view.shape[-1], heads)):
                            wrong.append([local, t, layer])
                    continue
                for j, b in enumerate(blocks):
                    if not torch.equal(caches[layer_name][b].cpu(), block_bytes(name, j, layer, tuple(caches[layer_name][b].shape))):
                        wrong.append([local, j, layer])
            for layer_name in MAMBA_LAYERS if args.mamba else []:  # the state block, every byte of the state
                view = caches[layer_name][states[local][0]]
                want = state_bytes(name, int(layer_name.split(".")[2]), args.tp_size, args.tp_rank)
                if not torch.equal(view.cpu(), want.view(view.shape)):
                    wrong.append([local, "state", layer_name])
        open(f"{path}.done{args.tp_rank}", "w").close()
    links = getattr(getattr(worker, "worker", None), "links", None)  # (kvplan's connector: vLLM's has none)
    decodes = links.decodes if links is not None else {}
    integrity = sorted({bool(d.integrity) for d in decodes.values()})
    retired_open = len(links.retired) if links is not None else 0  # (closed once nothing used them)
    worker.shutdown()
    ghost_blocks = sorted(mine["d-req-" + str(next(i for i, p in enumerate(all_params)
                                                  if p["remote_request_id"] == "p-req-ghost"))][1]) if args.ghost else []
    return {"received": sorted(received), "failed": sorted(failed), "invalid_blocks": sorted(invalid),
            "ghost_blocks": ghost_blocks, "wrong": wrong, "requests": sorted(mine),
            "blocks_checked": sum(len(b) for n, (_, b, _) in mine.items() if n in received - failed),
            "tokens_checked": tokens_checked, "states_checked": sum(len(states[n]) for n in received - failed),
            "pairing_after_first_step": pairing_after_first_step, "integrity": integrity,
            "endpoints": len(decodes), "retired_open": retired_open,
            "stats": STATS[0].reduce() if STATS else None, "step": step_stats(receiving_steps),
            "ready": step_stats([ready_s[n] for n in received - failed]),
            "wall_s": round(max(ready_s.values(), default=0.0), 4),
            "bytes": sum(len(b) * sum(caches[name][0].nbytes for name in LAYERS) for n, (_, b, _) in mine.items()
                         if n in received - failed)}


def run(argv: list[str]) -> dict:
    """One side, to its end: what it saw (the JSON line :func:`main` prints)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("prefill", "decode"))
    parser.add_argument("--port", type=int, default=17500)
    parser.add_argument("--params", required=True)
    parser.add_argument("--layout", default="LBNHC")
    parser.add_argument("--engine", default="nixl")
    parser.add_argument("--mode", default="auto")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--lengths", type=int, nargs="*", default=[100, 37, 64, 5])
    parser.add_argument("--ghost", action="store_true")
    parser.add_argument("--max-requests", type=int, default=0,
                        help="the connector's max_requests (its planning rows); 0: vLLM's max_num_seqs")
    parser.add_argument("--prefix-hit", type=int, default=0,
                        help="(decode) tokens of each prompt its prefix cache holds (whole blocks; never all of it)")
    parser.add_argument("--names", default="p-req-", help="(prefill) its requests' names: this and a number")
    parser.add_argument("--then-params", nargs="*", default=[],
                        help="(decode) once every request of --params is received and checked, those of each of these")
    parser.add_argument("--integrity", action="store_true", help="(decode) the connector's integrity key on")
    parser.add_argument("--exit-early", action="store_true")
    parser.add_argument("--block-size", type=int, default=BLOCK)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--decode-ranks", type=int, default=1, help="(prefill) the decode ranks it serves")
    parser.add_argument("--by-token", action="store_true", help="fill and check each token (the sides' blocks differ)")
    parser.add_argument("--window", type=int, default=0, help="a sliding-window group of this many tokens too")
    parser.add_argument("--window-block-size", type=int, default=0,
                        help="(--window) the sliding-window group's block size, padded to the full group's page")
    parser.add_argument("--mamba", action="store_true", help="a Mamba group too (the prefill leaves the last token)")
    parser.add_argument("--scratch-blocks", type=int, default=0, help="(--mamba) speculative blocks after the state's")
    parser.add_argument("--connector", choices=("kvplan", "nixl"), default="kvplan",
                        help="kvplan's connector, or vLLM's own NixlConnector (the baseline; TP 1, full attention)")
    parser.add_argument("--device", default="cpu", help="where the KV lives: cpu, or cuda (the benchmarks on a card)")
    parser.add_argument("--shape", type=int, nargs=3, metavar=("LAYERS", "HEADS", "HEAD_SIZE"),
                        help="the model's full-attention layers, KV heads and head size (default 3 2 16)")
    parser.add_argument("--freed-window-block", action="store_true",
                        help="(prefill) its first request's first window block freed: it must fail, never land")
    args = parser.parse_args(argv)
    if args.prefix_hit and (args.window or args.mamba or args.prefix_hit % args.block_size):
        parser.error("--prefix-hit is whole blocks of full attention only")
    if args.shape:
        if args.window or args.mamba:
            parser.error("--shape is for full attention only (the other groups' layers follow the default's)")
        use_shape(*args.shape)
    return prefill(args) if args.role == "prefill" else decode(args)


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(run(sys.argv[1:] if argv is None else argv)), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
