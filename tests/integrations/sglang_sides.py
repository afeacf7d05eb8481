"""The two processes of the SGLang adapter hand-off test: a prefill and a decode, each with SGLang's
``KVArgs`` over its own host memory, driven as SGLang's scheduler drives its sender and receiver."""

from __future__ import annotations

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


def kv_args_of(base_module, kv, aux):
    args = base_module.KVArgs()
    args.kv_data_ptrs = [t.data_ptr() for t in kv]
    args.kv_data_lens = [t.numel() for t in kv]
    args.kv_item_lens = [PAGE * TOKEN_BYTES] * len(kv)
    args.kv_layer_ids, args.prefill_start_layer, args.prefill_end_layer = None, 0, None
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [aux.data_ptr()], [aux.numel()], [AUX_BYTES]
    args.state_types, args.state_data_ptrs, args.state_item_lens = [], [], []
    args.page_size, args.engine_rank, args.kv_head_num, args.total_kv_head_num, args.gpu_id = PAGE, 0, 1, 1, 0
    return args


def page_lists(seed: int):
    """Per request: (prefill pages, decode pages, prefill aux row, decode aux row); the decode's
    lists cover the tokens past its prefix."""
    rng = np.random.default_rng(seed)
    src_free, dst_free = iter(rng.permutation(np.arange(1, PAGES))), iter(rng.permutation(np.arange(1, PAGES)))
    out = {}
    for k, (room, tokens, prefix, _) in enumerate(REQUESTS):
        n = -(-(tokens - prefix) // PAGE)
        out[room] = (np.array([next(src_free) for _ in range(n)]), np.array([next(dst_free) for _ in range(n)]),
                     k + 1, AUX_ROWS - 1 - k)
    return out


def run_prefill(engine: str, port: int, seed: int, results, deadline_s: float, state: bool = False) -> None:
    from tests.sglang_real import sglang_module

    base = sglang_module("srt.disaggregation.base.conn")
    utils = sglang_module("srt.disaggregation.utils")
    from kvplan.integrations.sglang.adapter import KVManager, KVSender

    kv, aux = pools(seed)
    server_args = types.SimpleNamespace(disaggregation_transfer_backend=engine, disaggregation_bootstrap_port=port,
                                        max_running_requests=8, context_length=64, kvplan_mode="direct")
    args = kv_args_of(base, kv, aux)
    mamba = mamba_pool(seed) if state else []
    mgr = KVManager(with_mamba(args, mamba) if state else args, utils.DisaggregationMode.PREFILL, server_args)
    lists = page_lists(seed)
    senders = {}
    for room, tokens, prefix, chunks in REQUESTS:
        sender = KVSender(mgr, f"127.0.0.1:{port}", room)
        sender.init(len(lists[room][0]), aux_index=lists[room][2])
        senders[room] = sender
    deadline = time.monotonic() + deadline_s
    seen = {room: [] for room in senders}
    while any(s.poll() == base.KVPoll.Bootstrapping for s in senders.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    # one scheduler step: every request's first chunk; the next step: the rest
    for step in range(2):
        for room, tokens, prefix, chunks in REQUESTS:
            pages = lists[room][0]
            cut = len(pages) // 2 if chunks == 2 else 0
            part = pages[:cut] if step == 0 and cut else pages[cut:] if step == 1 and cut else pages if step == 0 else []
            last = step == 1 or chunks == 1
            if len(part):  # SGLang hands the state indices with the last chunk only
                slots = [[mamba_slots(room)[0]]] if state and last else None
                senders[room].send(torch.from_numpy(part.astype(np.int32)), state_indices=slots)
        for room, sender in senders.items():
            seen[room].append(int(sender.poll()))
    while any(s.poll() not in (base.KVPoll.Success, base.KVPoll.Failed) for s in senders.values()) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    results.put(("prefill", {room: seen[room] + [int(s.poll())] for room, s in senders.items()},
                 {room: mgr.failures.get(room) for room in senders}))
    time.sleep(0.5)  # let the last notifications leave before the engine goes


def run_decode(engine: str, port: int, seed: int, results, deadline_s: float, state: bool = False) -> None:
    from tests.sglang_real import sglang_module

    base = sglang_module("srt.disaggregation.base.conn")
    utils = sglang_module("srt.disaggregation.utils")
    from kvplan.integrations.sglang.adapter import KVManager, KVReceiver

    kv, aux = pools(None)
    server_args = types.SimpleNamespace(disaggregation_transfer_backend=engine, kvplan_timeout_s=deadline_s)
    args = kv_args_of(base, kv, aux)
    mamba = mamba_pool(None) if state else []
    mgr = KVManager(with_mamba(args, mamba) if state else args, utils.DisaggregationMode.DECODE, server_args)
    lists = page_lists(seed)
    receivers, seen = {}, {}
    for room, tokens, prefix, _ in REQUESTS:
        receiver = KVReceiver(mgr, f"127.0.0.1:{port}", room)
        seen[room] = [int(receiver.poll())]
        receiver.init(0)
        seen[room].append(int(receiver.poll()))
        receiver.send_metadata(torch.from_numpy(lists[room][1].astype(np.int32)), aux_index=lists[room][3],
                               decode_prefix_len=prefix, state_indices=[[mamba_slots(room)[1]]] if state else None)
        receivers[room] = receiver
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        states = {room: int(r.poll()) for room, r in receivers.items()}
        for room, state in states.items():
            if seen[room][-1] != state:
                seen[room].append(state)
        if all(s in (base.KVPoll.Success, base.KVPoll.Failed) for s in states.values()):
            break
        time.sleep(0.001)
    src_kv, src_aux = pools(seed)
    wrong = []
    for room, (src_pages, dst_pages, src_row, dst_row) in lists.items():
        for s_t, d_t in zip(src_kv, kv):
            item = PAGE * TOKEN_BYTES
            for sp, dp in zip(src_pages, dst_pages):
                if not torch.equal(s_t[sp * item : (sp + 1) * item], d_t[dp * item : (dp + 1) * item]):
                    wrong.append((room, int(dp)))
        if not torch.equal(src_aux[src_row * AUX_BYTES : (src_row + 1) * AUX_BYTES],
                           aux[dst_row * AUX_BYTES : (dst_row + 1) * AUX_BYTES]):
            wrong.append((room, "aux"))
        for item, s_t, d_t in zip(MAMBA_ITEMS, mamba_pool(seed) if state else [], mamba):
            src_slot, dst_slot = mamba_slots(room)
            if not torch.equal(s_t[src_slot * item : (src_slot + 1) * item], d_t[dst_slot * item : (dst_slot + 1) * item]):
                wrong.append((room, "mamba", item))
    results.put(("decode", seen, wrong))
