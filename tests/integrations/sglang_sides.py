"""The two processes of the SGLang adapter hand-off test: a prefill and a decode, each with SGLang's
``KVArgs`` over its own host memory, driven as SGLang's scheduler drives its sender and receiver."""

from __future__ import annotations

import os
import time
import types

import numpy as np
import torch

PAGE, PAGES, TOKEN_BYTES, LAYERS, AUX_ROWS, AUX_BYTES = 4, 32, 64, 2, 16, 32
MAMBA_ITEMS, MAMBA_SLOTS = (96, 256), 8  # a conv and a temporal tensor per slot (``state=True``)
# (room, prompt tokens, decode prefix, chunks)
REQUESTS = ((100, 37, 0, 1), (101, 50, 8, 2), (102, 9, 0, 1))


def _buffer(rng, size: int, filled: bool) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8) if filled else np.zeros(size, np.uint8))


def pools(seed: int | None):
    """KV (K and V per layer) and one aux buffer; filled from ``seed`` (the source), else zero."""
    rng = np.random.default_rng(seed)
    kv = [_buffer(rng, PAGES * PAGE * TOKEN_BYTES, seed is not None) for _ in range(2 * LAYERS)]
    return kv, _buffer(rng, AUX_ROWS * AUX_BYTES, seed is not None)


def mamba_pool(seed: int | None):
    """A Mamba component's tensors (``MAMBA_SLOTS`` slots each), filled from ``seed`` or zero."""
    rng = np.random.default_rng(None if seed is None else seed + 1)
    return [_buffer(rng, MAMBA_SLOTS * item, seed is not None) for item in MAMBA_ITEMS]


def with_mamba(args, mamba):
    """``KVArgs`` that also register a Mamba component, as SGLang's multi-component form does."""
    args.state_types = ["mamba"]
    args.state_data_ptrs = [[t.data_ptr() for t in mamba]]
    args.state_data_lens = [[t.numel() for t in mamba]]
    args.state_item_lens = [list(MAMBA_ITEMS)]
    return args


def mamba_slots(room: int) -> tuple[int, int]:
    """A request's Mamba slot on the prefill and on the decode side."""
    k = [r for r, *_ in REQUESTS].index(room)
    return 1 + k, MAMBA_SLOTS - 1 - k


# ``state="hybrid"``: an SWA component (a window of SWA_WINDOW tokens, K and V per layer in a pool of
# its own pages) and a DSA indexer (one entry per layer, paged like the KV), as SGLang's multi-component
# KVArgs register them; two requests after a decode prefix (SGLang's SWA and DSA lists start there, and
# so do the adapter's: planning.md §6's from_prefix; the last one's window reaches into its prefix), each
# last chunk with its true token count (SGLang's num_kv_tokens)
SWA_WINDOW, SWA_PAGES, DSA_BYTES = 9, 16, 16
# and an SWA ring: RING_SIZE rows per request-pool row, the last RING_WINDOW positions move
RING_SIZE, RING_WINDOW, RING_BYTES, POOL_ROWS = 16, 6, 32, 8
HYBRID_REQUESTS = ((100, 37, 0, 1), (101, 50, 8, 2), (102, 13, 8, 1))
STATE_PARAMS = [{"window": SWA_WINDOW}, {}, {"window": RING_WINDOW, "ring_size": RING_SIZE}]


def requests_of(state) -> tuple:
    return HYBRID_REQUESTS if state == "hybrid" else REQUESTS


def hybrid_pools(seed: int | None):
    """The SWA pool's tensors (K and V per layer) and the indexer's (one per layer)."""
    rng = np.random.default_rng(None if seed is None else seed + 2)
    swa = [_buffer(rng, SWA_PAGES * PAGE * TOKEN_BYTES, seed is not None) for _ in range(2 * LAYERS)]
    dsa = [_buffer(rng, PAGES * PAGE * DSA_BYTES, seed is not None) for _ in range(LAYERS)]
    ring = [_buffer(rng, POOL_ROWS * RING_SIZE * RING_BYTES, seed is not None) for _ in range(LAYERS)]
    return swa, dsa, ring


def with_hybrid(args, swa, dsa, ring):
    args.state_types = ["swa", "dsa", "swa_ring"]
    args.state_data_ptrs = [[t.data_ptr() for t in x] for x in (swa, dsa, ring)]
    args.state_data_lens = [[t.numel() for t in x] for x in (swa, dsa, ring)]
    args.state_item_lens = [[PAGE * TOKEN_BYTES] * len(swa), [PAGE * DSA_BYTES] * len(dsa), [RING_BYTES] * len(ring)]
    return args


def ring_rows(room: int, side: int) -> np.ndarray:
    """SGLang's ring rows of a request (its request-pool row differs on the two sides)."""
    k = [r for r, *_ in HYBRID_REQUESTS].index(room)
    tokens = HYBRID_REQUESTS[k][1]
    pool_row = (2 + 2 * k, POOL_ROWS - 1 - 2 * k)[side]
    return pool_row * RING_SIZE + np.arange(max(0, tokens - RING_WINDOW), tokens) % RING_SIZE


def window_pages(seed: int):
    """Per request: the SWA pages of its window on the prefill and on the decode side (SGLang's
    translated window: the pages of [floor(max(P, L - W) / ps) * ps, L) after a decode prefix P)."""
    rng = np.random.default_rng(seed + 3)
    src_free, dst_free = iter(rng.permutation(np.arange(1, SWA_PAGES))), iter(rng.permutation(np.arange(1, SWA_PAGES)))
    out = {}
    for room, tokens, prefix, _ in HYBRID_REQUESTS:
        start = max(prefix, tokens - SWA_WINDOW) // PAGE * PAGE
        n = -(-(tokens - start) // PAGE)
        out[room] = (np.array([next(src_free) for _ in range(n)]), np.array([next(dst_free) for _ in range(n)]))
    return out


def with_state(args, state, seed: int | None):
    """``KVArgs`` with the state of ``state`` (False, True: Mamba, "hybrid"), and its pools."""
    if state == "hybrid":
        pools_ = hybrid_pools(seed)
        return with_hybrid(args, *pools_), pools_
    if state:
        mamba = mamba_pool(seed)
        return with_mamba(args, mamba), (mamba,)
    return args, ()


def state_indices(state, room: int, side: int, lists, seed: int) -> list | None:
    """What SGLang hands with a last chunk (side 0) or with the metadata (side 1)."""
    if state == "hybrid":
        return [window_pages(seed)[room][side], lists[room][side], ring_rows(room, side)]
    return [[mamba_slots(room)[side]]] if state else None


def kv_args_of(base_module, kv, aux):
    args = base_module.KVArgs()
    args.kv_data_ptrs = [t.data_ptr() for t in kv]
    args.kv_data_lens = [t.numel() for t in kv]
    args.kv_item_lens = [PAGE * TOKEN_BYTES] * len(kv)
    args.kv_layer_ids, args.prefill_start_layer, args.prefill_end_layer = None, 0, None
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [aux.data_ptr()], [aux.numel()], [AUX_BYTES]
    args.state_types, args.state_data_ptrs, args.state_item_lens = [], [], []
    args.page_size, args.engine_rank, args.kv_head_num, args.total_kv_head_num, args.gpu_id = PAGE, 0, 1, 1, 0
    args.kv_cache_dtype_str = "bfloat16"
    return args


def page_lists(seed: int, hybrid: bool = False):
    """Per request: (prefill pages, decode pages, prefill aux row, decode aux row); the decode's
    lists cover the tokens past its prefix."""
    rng = np.random.default_rng(seed)
    src_free, dst_free = iter(rng.permutation(np.arange(1, PAGES))), iter(rng.permutation(np.arange(1, PAGES)))
    out = {}
    for k, (room, tokens, prefix, _) in enumerate(HYBRID_REQUESTS if hybrid else REQUESTS):
        n = -(-(tokens - prefix) // PAGE)
        out[room] = (np.array([next(src_free) for _ in range(n)]), np.array([next(dst_free) for _ in range(n)]),
                     k + 1, AUX_ROWS - 1 - k)
    return out


def scheduler_steps(state, lists, seed: int):
    """What SGLang's prefill scheduler sends, step by step: every request's first chunk in the first
    step, the rest in the next. Each send is ``(room, pages, state_indices, num_kv_tokens)``: the state
    indices come with the last chunk only, and each chunk counts its tokens."""
    for step in range(2):
        sends = []
        for room, tokens, prefix, chunks in requests_of(state):
            pages = lists[room][0]
            cut = len(pages) // 2 if chunks == 2 else 0
            part = pages[:cut] if step == 0 and cut else pages[cut:] if step == 1 and cut else pages if step == 0 else []
            last = step == 1 or chunks == 1
            if len(part):
                ids = state_indices(state, room, 0, lists, seed) if last else None
                sends.append((room, part, ids, tokens - prefix - cut * PAGE if last else len(part) * PAGE))
        yield sends


def decode_lens(state) -> dict:
    """The decode side's buffer lengths (its pools are shaped as the prefill's), as ``KVArgs`` name them."""
    kv, aux = pools(None)
    args, _ = with_state(types.SimpleNamespace(), state, None)
    return {"kv_data_lens": [t.numel() for t in kv], "aux_data_lens": [aux.numel()],
            "state_data_lens": getattr(args, "state_data_lens", [])}


def bootstrap_server(port: int):
    """SGLang's own bootstrap server on 127.0.0.1:``port`` (as an SGLang prefill node runs it), once it
    answers its health check."""
    import urllib.request

    from tests.sglang_real import sglang_module

    server = sglang_module("srt.disaggregation.mooncake.conn").MooncakeKVBootstrapServer("127.0.0.1", port)
    opener, deadline = urllib.request.build_opener(urllib.request.ProxyHandler({})), time.monotonic() + 10
    while True:
        try:
            with opener.open(f"http://127.0.0.1:{port}/health", timeout=1) as answer:
                if answer.status == 200:
                    return server
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _backend(engine: str) -> str:
    """SGLang's ``--disaggregation-transfer-backend`` for a test's engine: ``ipc`` is kvplan's own, under
    SGLang's ``nixl`` backend, as a deployment sets it (``KVPLAN_ENGINE=ipc``)."""
    return "nixl" if engine == "ipc" else engine


def _engine(engine: str) -> str | None:
    return "ipc" if engine == "ipc" else None


def run_prefill(engine: str, port: int, seed: int, results, deadline_s: float, state: bool = False,
                protocol: str = "kvplan", decode_kv_pages: int = PAGES, decode_tp: int = 1, staging_mib: int = 0) -> None:
    """kvplan's prefill manager (with ``staging_mib``, mode ``staged`` through a buffer of that size, and the
    mode its last batch used is reported); with ``protocol="sglang"`` it serves SGLang's own decode ranks
    through SGLang's bootstrap server, which this process runs, told that the decode's KV pools
    hold ``decode_kv_pages`` pages. With ``decode_tp`` > 1 its pages hold that many KV heads, one per
    decode rank (attention TP 1 to ``decode_tp``: head-sliced)."""
    from tests.sglang_real import sglang_module

    base = sglang_module("srt.disaggregation.base.conn")
    utils = sglang_module("srt.disaggregation.utils")
    from kvplan.integrations.sglang.adapter import KVManager, KVSender

    kv, aux = pools(seed)
    server_args = types.SimpleNamespace(disaggregation_transfer_backend=_backend(engine), kvplan_engine=_engine(engine),
                                        disaggregation_bootstrap_port=port, host="127.0.0.1", kvplan_host="127.0.0.1",
                                        max_running_requests=8, context_length=64,
                                        kvplan_mode="staged" if staging_mib else "direct", kvplan_staging_mib=staging_mib,
                                        kvplan_state_params=STATE_PARAMS if state == "hybrid" else None,
                                        kvplan_protocol=protocol,
                                        kvplan_decode_lens={**decode_lens(state), "kv_data_lens": [
                                            decode_kv_pages * PAGE * TOKEN_BYTES // decode_tp] * 2 * LAYERS})
    args, _ = with_state(kv_args_of(base, kv, aux), state, seed)
    args.kv_head_num = args.total_kv_head_num = decode_tp
    server = bootstrap_server(port)  # SGLang's, as its prefill node runs it: kvplan registers its rank there
    mgr = KVManager(args, utils.DisaggregationMode.PREFILL, server_args)
    lists = page_lists(seed, state == "hybrid")
    senders = {}
    for room, tokens, prefix, chunks in requests_of(state):
        sender = KVSender(mgr, f"127.0.0.1:{port}", room)
        sender.init(len(lists[room][0]), aux_index=lists[room][2])
        senders[room] = sender
    deadline = time.monotonic() + deadline_s
    seen = {room: [] for room in senders}
    while any(s.poll() == base.KVPoll.Bootstrapping for s in senders.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    for sends in scheduler_steps(state, lists, seed):
        for room, part, ids, count in sends:
            senders[room].send(torch.from_numpy(part.astype(np.int32)), state_indices=ids, num_kv_tokens=count)
        for room, sender in senders.items():
            seen[room].append(int(sender.poll()))
    while any(s.poll() not in (base.KVPoll.Success, base.KVPoll.Failed) for s in senders.values()) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    results.put(("prefill", {room: seen[room] + [int(s.poll())] for room, s in senders.items()},
                 {room: mgr.failures.get(room) for room in senders}) + ((mgr.prefill.last_mode,) if staging_mib else ()))
    time.sleep(0.5)  # let the last notifications leave before the engine goes
    mgr.close()
    server.close()


def run_decode(engine: str, port: int, seed: int, results, deadline_s: float, state: bool = False,
               rooms: tuple | None = None, name: str = "decode", protocol: str = "kvplan", integrity: bool = False,
               staging_mib: int = 0, early_metadata: bool = False) -> None:
    """A decode manager receiving ``rooms`` (all requests by default); reports as ``name``. With
    ``protocol="sglang"`` it is served by SGLang's own prefill; with ``integrity`` it asks for checksums;
    with ``early_metadata`` each request's lists are handed right after ``init``, before its pairing ended."""
    from tests.sglang_real import sglang_module

    base = sglang_module("srt.disaggregation.base.conn")
    utils = sglang_module("srt.disaggregation.utils")
    from kvplan.integrations.sglang.adapter import KVManager, KVReceiver

    kv, aux = pools(None)
    server_args = types.SimpleNamespace(disaggregation_transfer_backend=_backend(engine), kvplan_engine=_engine(engine),
                                        kvplan_timeout_s=deadline_s,
                                        kvplan_state_params=STATE_PARAMS if state == "hybrid" else None,
                                        kvplan_protocol=protocol, host="127.0.0.1", kvplan_host="127.0.0.1",
                                        kvplan_integrity=integrity, kvplan_staging_mib=staging_mib)
    args, state_pools = with_state(kv_args_of(base, kv, aux), state, None)
    mgr = KVManager(args, utils.DisaggregationMode.DECODE, server_args)
    lists = page_lists(seed, state == "hybrid")
    receivers, seen = {}, {}
    for room, tokens, prefix, _ in (r for r in requests_of(state) if rooms is None or r[0] in rooms):
        receiver = KVReceiver(mgr, f"127.0.0.1:{port}", room)
        seen[room] = [int(receiver.poll())]
        if protocol == "sglang":
            _until_registered(port, deadline_s)
        # as SGLang's decode scheduler does: the prefill's layout first (tried again until known), then init
        until = time.monotonic() + deadline_s
        while not mgr.try_ensure_parallel_info(f"127.0.0.1:{port}") and time.monotonic() < until:
            time.sleep(0.05)
        receiver.init(0)
        # as SGLang's decode does: the metadata once the receiver stopped bootstrapping (its pairing runs off-thread)
        while not early_metadata and receiver.poll() == base.KVPoll.Bootstrapping and time.monotonic() < until:
            time.sleep(0.002)
        seen[room].append(int(receiver.poll()))
        receiver.send_metadata(torch.from_numpy(lists[room][1].astype(np.int32)), aux_index=lists[room][3],
                               decode_prefix_len=prefix, state_indices=state_indices(state, room, 1, lists, seed))
        receivers[room] = receiver
    deadline = time.monotonic() + deadline_s
    watch(receivers, seen, deadline)
    wrong = wrong_bytes(state, seed, lists, rooms, kv, aux, state_pools)
    if integrity and not (mgr.decode is not None and mgr.decode.integrity):  # (its requests completed on sums only)
        wrong.append("the decode endpoint asked for no checksums")
    mgr.close()
    results.put((name, seen, wrong))


def watch(pollers: dict, seen: dict, deadline: float) -> None:
    """Poll each room's sender or receiver until all have concluded (``Success`` or ``Failed``) or the
    deadline passes, appending each new ``KVPoll`` state to the room's list in ``seen``."""
    from tests.sglang_real import sglang_module

    poll = sglang_module("srt.disaggregation.base.conn").KVPoll
    done = {int(poll.Success), int(poll.Failed)}
    while time.monotonic() < deadline:
        states = {room: int(p.poll()) for room, p in pollers.items()}
        for room, now in states.items():
            if seen[room][-1] != now:
                seen[room].append(now)
        if all(x in done for x in states.values()):
            return
        time.sleep(0.001)


def wrong_bytes(state, seed: int, lists, rooms, kv, aux, state_pools) -> list:
    """What differs between the prefill's pools (made again from ``seed``) and the decode's, for
    ``rooms`` (all by default): KV pages, aux rows and every state kind's items."""
    src_kv, src_aux = pools(seed)
    wrong = []
    for room, (src_pages, dst_pages, src_row, dst_row) in lists.items():
        if rooms is not None and room not in rooms:
            continue
        for s_t, d_t in zip(src_kv, kv):
            item = PAGE * TOKEN_BYTES
            for sp, dp in zip(src_pages, dst_pages):
                if not torch.equal(s_t[sp * item : (sp + 1) * item], d_t[dp * item : (dp + 1) * item]):
                    wrong.append((room, int(dp)))
        if not torch.equal(src_aux[src_row * AUX_BYTES : (src_row + 1) * AUX_BYTES],
                           aux[dst_row * AUX_BYTES : (dst_row + 1) * AUX_BYTES]):
            wrong.append((room, "aux"))
        if state == "hybrid":  # every window page of every SWA tensor, every indexer page
            src_swa, src_dsa, src_ring = hybrid_pools(seed)
            pairs = [(s_t, d_t, PAGE * TOKEN_BYTES, zip(*window_pages(seed)[room]), "swa")
                     for s_t, d_t in zip(src_swa, state_pools[0])]
            pairs += [(s_t, d_t, PAGE * DSA_BYTES, zip(src_pages, dst_pages), "dsa")
                      for s_t, d_t in zip(src_dsa, state_pools[1])]
            pairs += [(s_t, d_t, RING_BYTES, zip(ring_rows(room, 0), ring_rows(room, 1)), "ring")
                      for s_t, d_t in zip(src_ring, state_pools[2])]
            for s_t, d_t, item, ids, what in pairs:
                for sp, dp in ids:
                    if not torch.equal(s_t[sp * item : (sp + 1) * item], d_t[dp * item : (dp + 1) * item]):
                        wrong.append((room, what, int(dp)))
        elif state:
            for item, s_t, d_t in zip(MAMBA_ITEMS, mamba_pool(seed), state_pools[0]):
                src_slot, dst_slot = mamba_slots(room)
                if not torch.equal(s_t[src_slot * item : (src_slot + 1) * item],
                                   d_t[dst_slot * item : (dst_slot + 1) * item]):
                    wrong.append((room, "mamba", item))
    return wrong


def wrong_head_bytes(seed: int, lists, kv, aux, tp_rank: int, tp_size: int) -> list:
    """What differs on decode rank ``tp_rank`` of ``tp_size``: each KV page must hold that rank's head of
    every token of the prefill's page (tokens of ``tp_size`` heads), and the aux row the prefill's."""
    src_kv, src_aux = pools(seed)
    item, wrong = PAGE * TOKEN_BYTES, []
    for room, (src_pages, dst_pages, src_row, dst_row) in lists.items():
        for s_t, d_t in zip(src_kv, kv):
            for sp, dp in zip(src_pages, dst_pages):
                heads = s_t[sp * item : (sp + 1) * item].reshape(PAGE, tp_size, -1)[:, tp_rank]
                if not torch.equal(heads.reshape(-1), d_t[dp * item // tp_size : (dp + 1) * item // tp_size]):
                    wrong.append((room, int(dp)))
        if not torch.equal(src_aux[src_row * AUX_BYTES : (src_row + 1) * AUX_BYTES],
                           aux[dst_row * AUX_BYTES : (dst_row + 1) * AUX_BYTES]):
            wrong.append((room, "aux"))
    return wrong


def sglang_kv_args(base, kv, aux):
    """``KVArgs`` with every field SGLang's own managers read at construction (``kv_args_of`` fills
    those kvplan reads)."""
    args = kv_args_of(base, kv, aux)
    args.kv_layer_ids, args.ib_device = list(range(len(kv))), None
    args.state_data_lens, args.state_layer_ids, args.state_dim_per_tensor = [], [], []
    args.state_slice_outer_counts = []
    args.state_conv_shard_groups, args.is_hybrid_mla_backend, args.swa_kv_cache_layout = [], False, None
    args.system_dp_rank, args.rust_http_port, args.pp_rank, args.mla_compression_ratios = 0, None, 0, None
    args.kv_buf_groups, args.hidden_kv_layers = 1, 0
    return args


# per backend: SGLang's module, its manager, sender and receiver classes
SGLANG_CLASSES = {"mooncake": ("mooncake", "Mooncake"), "nixl": ("nixl", "Nixl")}


def _nixl_as_sglang_imports_it() -> None:
    """SGLang imports ``nixl._api``; the wheel installed here is ``nixl_cu12`` (or ``nixl_cu13``): the
    same module under its package's name."""
    import importlib
    import sys

    for name in ("nixl", "nixl_cu13", "nixl_cu12"):
        try:
            api = importlib.import_module(f"{name}._api")
        except ImportError:
            continue
        sys.modules.setdefault("nixl", importlib.import_module(name))
        sys.modules.setdefault("nixl._api", api)
        return
    raise ImportError("no NIXL package is installed")


def sglang_manager(mode: str, port: int, args, backend: str = "mooncake", tp_rank: int = 0, tp_size: int = 1):
    """SGLang's own KV manager of ``backend`` in ``mode`` ("prefill" or "decode"), on 127.0.0.1 (Mooncake
    over its TCP transport, NIXL over UCX on ``lo`` with the KV in host memory), under a published test
    configuration (SGLang's ``override_server_args``): attention rank ``tp_rank`` of ``tp_size``, no
    pipeline group. Returns SGLang's module of that backend and the manager."""
    from tests.sglang_real import sglang_module

    os.environ.update(SGLANG_HOST_IP="127.0.0.1", MOONCAKE_PROTOCOL="tcp", MC_FORCE_TCP="1", UCX_NET_DEVICES="lo",
                      NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    context = sglang_module("srt.runtime_context")
    utils = sglang_module("srt.disaggregation.utils")
    module, prefix = SGLANG_CLASSES[backend]
    if backend == "nixl":
        _nixl_as_sglang_imports_it()
        args.kv_data_mem_kinds = ["DRAM"] * len(args.kv_data_ptrs)
    conn = sglang_module(f"srt.disaggregation.{module}.conn")
    server_args = context.get_context().override_server_args(
        disaggregation_mode=mode, disaggregation_transfer_backend=backend, disaggregation_bootstrap_port=port,
        host="127.0.0.1", page_size=PAGE, device="cpu", tp_size=tp_size).install()
    context.get_parallel().override_permanently(attn_tp_rank=tp_rank, attn_cp_rank=0, attn_dcp_rank=0,
                                                attn_dp_rank=0, pp_group=None)
    if backend == "mooncake":
        sglang_module("srt.distributed.device_communicators.mooncake_transfer_engine").init_mooncake_transfer_engine(
            "127.0.0.1")
    manager = getattr(conn, f"{prefix}KVManager")(args, utils.DisaggregationMode(mode), server_args, False)
    return conn, manager


def _held_notifications(mgr, backend: str) -> int:
    """How many notifications the writes left in SGLang's engine, which SGLang never reads."""
    if backend == "nixl":
        return sum(len(v) for v in mgr.agent.get_new_notifs().values())
    return len(mgr.engine.engine.get_notifies())


def run_sglang_decode(port: int, seed: int, results, deadline_s: float, state: bool = False,
                      backend: str = "mooncake", tp_rank: int = 0, tp_size: int = 1) -> None:
    """SGLang's own decode side (its KV manager and receiver, unchanged) receiving every request from a
    kvplan prefill manager; reports as ``"decode"`` (``"decode-<rank>"`` with ``tp_size`` > 1: then it
    is attention rank ``tp_rank``, holding one KV head of ``tp_size``): the ``KVPoll`` states it saw,
    its failure records, the bytes that differ and how many notifications its engine holds."""
    from tests.sglang_real import sglang_module

    base = sglang_module("srt.disaggregation.base.conn")
    kv, aux = pools(None)
    if tp_size > 1:  # this rank's share: one head of each token
        kv = [torch.zeros(t.numel() // tp_size, dtype=torch.uint8) for t in kv]
    args, state_pools = with_state(sglang_kv_args(base, kv, aux), state, None)
    if tp_size > 1:
        args.kv_data_lens, args.kv_item_lens = [t.numel() for t in kv], [PAGE * TOKEN_BYTES // tp_size] * len(kv)
        args.engine_rank, args.kv_head_num, args.total_kv_head_num = tp_rank, 1, tp_size
    conn, mgr = sglang_manager("decode", port, args, backend, tp_rank, tp_size)
    address, deadline = f"127.0.0.1:{port}", time.monotonic() + deadline_s
    while not mgr.try_ensure_parallel_info(address):  # until the prefill rank has registered
        if time.monotonic() > deadline:
            raise TimeoutError(f"no prefill registered with the bootstrap server at {address}")
        time.sleep(0.05)
    lists = page_lists(seed, state == "hybrid")
    receivers, seen = {}, {}
    for room, tokens, prefix, _ in requests_of(state):
        receiver = getattr(conn, f"{SGLANG_CLASSES[backend][1]}KVReceiver")(mgr, address, room)
        seen[room] = [int(receiver.poll())]
        receiver.init(0)
        seen[room].append(int(receiver.poll()))
        receiver.send_metadata(lists[room][1].astype(np.int32), aux_index=lists[room][3], decode_prefix_len=prefix,
                               state_indices=state_indices(state, room, 1, lists, seed))
        receivers[room] = receiver
    watch(receivers, seen, deadline)
    wrong = wrong_bytes(state, seed, lists, None, kv, aux, state_pools) if tp_size == 1 else \
        wrong_head_bytes(seed, lists, kv, aux, tp_rank, tp_size)
    name = "decode" if tp_size == 1 else f"decode-{tp_rank}"
    results.put((name, seen, dict(mgr.failure_records), wrong, _held_notifications(mgr, backend)))
    results.close()
    results.join_thread()  # flushed before the exit below
    os._exit(0)  # SGLang's manager keeps daemon threads and sockets that have no close of their own


def _until_registered(port: int, deadline_s: float) -> None:
    """Wait until the bootstrap server on ``port`` reports the prefill's every rank registered."""
    from kvplan.integrations.sglang.bootstrap import BootstrapNotReady, prefill_layout

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            prefill_layout("127.0.0.1", port, timeout=1.0)
            return
        except (BootstrapNotReady, OSError) as err:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the prefill did not register with the bootstrap server at {port}") from err
            time.sleep(0.05)
        except Exception as err:  # noqa: BLE001 - the server is not up yet (connection refused)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no bootstrap server at {port}: {err}") from err
            time.sleep(0.05)


def run_sglang_prefill(port: int, seed: int, results, deadline_s: float, state: bool = False,
                       backend: str = "mooncake") -> None:
    """SGLang's own prefill side (its ``MooncakeKVManager`` and ``MooncakeKVSender``, unchanged, and its
    bootstrap server) sending every request to a kvplan decode manager as SGLang's scheduler does: every
    first chunk in one step, the rest in the next, the state lists and true token count with the last;
    reports as ``"prefill"``: the ``KVPoll`` states it saw and its failure records."""
    from tests.sglang_real import sglang_module

    base = sglang_module("srt.disaggregation.base.conn")
    server = bootstrap_server(port)
    kv, aux = pools(seed)
    args, _ = with_state(sglang_kv_args(base, kv, aux), state, seed)
    conn, mgr = sglang_manager("prefill", port, args, backend)
    lists = page_lists(seed, state == "hybrid")
    senders = {}
    for room, tokens, prefix, chunks in requests_of(state):
        sender = getattr(conn, f"{SGLANG_CLASSES[backend][1]}KVSender")(mgr, f"127.0.0.1:{port}", room)
        sender.init(len(lists[room][0]), aux_index=lists[room][2])
        senders[room] = sender
    deadline = time.monotonic() + deadline_s
    seen = {room: [int(s.poll())] for room, s in senders.items()}
    while any(s.poll() == base.KVPoll.Bootstrapping for s in senders.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    for sends in scheduler_steps(state, lists, seed):
        for room, part, ids, count in sends:
            senders[room].send(part.astype(np.int32), state_indices=ids, num_kv_tokens=count)
    watch(senders, seen, deadline)
    results.put(("prefill", seen, dict(mgr.failure_records)))
    results.close()
    results.join_thread()
    time.sleep(0.5)  # the last status messages leave before the process does
    server.close()
    os._exit(0)  # SGLang's manager keeps daemon threads and sockets that have no close of their own


def gather(procs: list, results, timeout: float = 150.0) -> dict:
    """Start ``procs`` (each puts one report, ``(name, *rest)``, on ``results``), then what each reported,
    by name; fails at once if one exits without reporting, or after ``timeout``. Each process is joined,
    or killed, by its own handle."""
    import queue

    for p in procs:
        p.start()
    got: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < len(procs):
            try:
                kind, *rest = results.get(timeout=1)
                got[kind] = rest
            except queue.Empty:
                dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                assert not dead and time.monotonic() < deadline, f"no report from every side; exited: {dead}"
        return got
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
