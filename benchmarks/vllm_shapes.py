"""vLLM-shaped batches through kvplan's vLLM connector (issue 39, item 4).

The KV of one TP rank of Llama-70B as vLLM 0.33 lays it out for the connector: 80 layers, blocks of 16
tokens, K and V packed in a block, bf16. TP 1 holds 8 KV heads (64 KiB per layer x block), TP 8 one
(8 KiB: vllm#50913's "8 KB descriptors"). Batches: 16 requests of 5,120 tokens and 4 of 32,768, their
blocks either scattered over the pool (``fragmented``: a long-running engine) or consecutive on both
sides (``contiguous``: a fresh one).

**Planning** (one process; each output checked equal to the baseline's before anything is timed):

* ``vllm-host``: what vLLM's NIXL connector computes per request from the scheduler's block lists, in
  NumPy: one descriptor id per layer x block on each side (``layer * num_blocks + block``), the formula
  of vLLM 0.33's ``NixlBaseConnectorWorker._compute_desc_ids`` for full attention
  (``tests/integrations/test_vllm_connector.py`` checks this function against vLLM's own);
* ``kvplan-prepared``: the same ids from the same block lists, as the connector's worker makes them: the
  blocks written into its planning table on the GPU, one batch planned there, the indices read back;
* the descriptor counts of that form and of kvplan's direct form (runs of blocks that are neighbours on
  both sides merged into one descriptor per layer).

Shapes: TP 1 and TP 8 (equal TP on both sides), and TP 4 -> 8 (``llama70b-tp4to8-lbhnc``): a prefill rank's
two heads, the second decode rank it serves taking one, in ``LBHNC``, the layout vLLM's NIXL connector asks
for. There vLLM prepares lists of each block's head slice once per peer (``_build_fa_remote``) and computes the
same ids per request; kvplan's prepared form is the same (``Attention.MHA_HEAD_MAJOR``), and its direct form
cannot merge (a page's slice is not next to the next page's).

**Moving** (two processes on one GPU, NIXL): the connector's worker side, prefill to decode, each batch
from the decode's publication of its blocks until vLLM would hear it finished receiving, every byte of
every block of every layer checked, in three modes: ``prepared`` (one descriptor per layer x block into
prepared lists: vLLM's NIXL connector's form), ``direct`` (kvplan's merged runs) and ``staged``
(gathered into a staging buffer, a few large writes, scattered on arrival).

``python -m benchmarks.vllm_shapes [--out DIR] [--scale S] [--no-transfer]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvplan.integrations.vllm.kv_caches import BlockView
from kvplan.planner.contract.block_tables import token_table_from_blocks
from kvplan.planner.device.columns import BatchColumns
from kvplan.planner.device.planner import Planner
from kvplan.planner.contract.batch import Batch, Transfer
from tests.ports import free_ports, free_span

BLOCK, LAYERS, HEAD_DIM = 16, 80, 128
# KV heads per prefill rank and the TP sizes (prefill, decode): between TP sizes the decode rank is the
# second of those the prefill rank serves, and both lay blocks out as vLLM's NIXL connector asks (LBHNC)
SHAPES = {"llama70b-tp1": (8, (1, 1)), "llama70b-tp8": (1, (1, 1)), "llama70b-tp4to8-lbhnc": (2, (4, 8))}
BATCHES = {"16x5k": (16, 5120), "4x32k": (4, 32768)}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def vllm_desc_ids(block_ids: list[int], num_blocks: int, layers: int) -> np.ndarray:
    """One request's descriptor ids on one side as vLLM's NIXL connector computes them for full attention:
    every layer's region (``num_blocks`` descriptors each, regions back to back) at each block."""
    region_offsets = np.arange(layers, dtype=np.int64) * num_blocks
    return (region_offsets[:, None] + np.asarray(block_ids, dtype=np.int32)[None, :]).ravel()


def allocate(requests: int, blocks_each: int, pool: int, fragmented: bool, rng: np.random.Generator) -> list[list[int]]:
    """Each request's blocks in a pool of ``pool``: scattered, or consecutive from a random start (block 0 is
    vLLM's null block: never a request's)."""
    if fragmented:
        order = rng.permutation(pool - 1) + 1
        return [order[r * blocks_each:(r + 1) * blocks_each].tolist() for r in range(requests)]
    starts = rng.permutation((pool - 1) // blocks_each)[:requests] * blocks_each + 1
    return [list(range(int(s), int(s) + blocks_each)) for s in starts]


def fake_view(heads: int, num_blocks: int, base: int, layers: int = LAYERS) -> BlockView:
    """A per-layer block view at made-up addresses (planning reads no memory), laid out as vLLM's NIXL
    connector asks (``LBHNC``: ``[blocks, heads, block_size, 2 * head_dim]`` contiguous)."""
    item = heads * BLOCK * 2 * HEAD_DIM * 2
    return BlockView.of({f"model.layers.{i}.attn": _Strided(base + i * item * num_blocks,
                                                            (num_blocks, heads, BLOCK, 2 * HEAD_DIM))
                         for i in range(layers)}, BLOCK)


class _Strided:
    """What :meth:`BlockView.of` reads of a contiguous per-layer KV view, without the memory."""

    def __init__(self, ptr: int, shape: tuple[int, ...]):
        self.ptr, self.shape, self.dtype, self.device = ptr, shape, torch.bfloat16, torch.device("cpu")

    def data_ptr(self) -> int:
        return self.ptr

    def dim(self) -> int:
        return len(self.shape)

    def stride(self, d: int | None = None):
        strides = tuple(int(np.prod(self.shape[k + 1:])) for k in range(len(self.shape)))
        return strides if d is None else strides[d]

    def element_size(self) -> int:
        return 2


def median_ms(fn, runs: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@dataclass
class PlanRow:
    shape: str
    batch: str
    placement: str
    descriptors_vllm: int
    descriptors_direct: int
    vllm_host_ms: float
    kvplan_prepared_ms: float
    kvplan_direct_ms: float

    @property
    def speedup(self) -> float:
        return self.vllm_host_ms / self.kvplan_prepared_ms


def plan_rows(scale: float, runs: int, device: torch.device) -> list[PlanRow]:
    rows = []
    layers = max(2, int(LAYERS * scale))
    for shape, (heads, (src_tp, dst_tp)) in SHAPES.items():
        for batch_name, (requests, tokens) in BATCHES.items():
            requests, tokens = max(1, int(requests * scale)), max(BLOCK, int(tokens * scale) // BLOCK * BLOCK)
            blocks_each = tokens // BLOCK
            src_pool, dst_pool = requests * blocks_each * 2, requests * blocks_each * 3
            for fragmented in (True, False):
                rng = np.random.default_rng(7)
                src_blocks = allocate(requests, blocks_each, src_pool, fragmented, rng)
                dst_blocks = allocate(requests, blocks_each, dst_pool, fragmented, rng)
                table = torch.zeros((requests + 1, blocks_each * BLOCK), dtype=torch.int32, device=device)
                src = fake_view(heads, src_pool, 1 << 40, layers).side(table, tp_size=src_tp)
                dst = fake_view(heads * src_tp // dst_tp, dst_pool, 1 << 44, layers).side(
                    tp_size=dst_tp, tp_rank=min(1, dst_tp // src_tp - 1))  # (between TP sizes: the second decode)

                def baseline():
                    local = [vllm_desc_ids(b, src_pool, layers) for b in src_blocks]
                    remote = [vllm_desc_ids(b, dst_pool, layers) for b in dst_blocks]
                    return np.concatenate(local), np.concatenate(remote)

                def batch() -> Batch:
                    ids = torch.from_numpy(np.asarray(src_blocks, dtype=np.int64)).to(device)
                    token_table_from_blocks(ids, BLOCK, out=table[1:])
                    return Batch(src, (dst,), [Transfer(f"r{r}", r + 1, 0, tokens, tokens, True,
                                                        np.asarray(dst_blocks[r], dtype=np.int64))
                                               for r in range(requests)])

                prepared = Planner(src, (dst,), outputs=("prepared",))
                direct = Planner(src, (dst,))
                ours = lambda: prepared.plan(BatchColumns.from_batch(batch())).prepared_indices()  # noqa: E731
                want, got = baseline(), ours()
                if not (np.array_equal(want[0], got.src) and np.array_equal(want[1], got.dst)):
                    raise AssertionError(f"{shape} {batch_name}: kvplan's prepared indices are not vLLM's descriptor ids")
                runs_direct = lambda: direct.plan(BatchColumns.from_batch(batch())).descriptors()[0]  # noqa: E731
                descs = runs_direct()
                if int(descs[:, 2].sum()) != len(want[0]) * min(src.kv.entries[0].item_len, dst.kv.entries[0].item_len):
                    raise AssertionError(f"{shape} {batch_name}: the direct descriptors do not cover every block once")
                rows.append(PlanRow(shape, batch_name, "fragmented" if fragmented else "contiguous", len(want[0]),
                                    len(descs), median_ms(baseline, runs), median_ms(ours, runs),
                                    median_ms(runs_direct, runs)))
    return rows


# -- moving: two processes ---------------------------------------------------------------------------
def _settings(port: int, mode: str, warm_up: bool, tp_size: int = 1, engine: str = "nixl"):
    from kvplan.integrations.vllm.settings import WARM_UP, Settings

    return Settings.parse({"host": "127.0.0.1", "port": port, "engine": engine, "mode": mode, "timeout_s": 120,
                           "max_requests": 64, "warm_up": WARM_UP if warm_up else {}}, tp_size=tp_size)


def _caches(heads: int, num_blocks: int, layers: int, device: torch.device,
            tokens_outermost: bool = False) -> dict[str, torch.Tensor]:
    """Per-layer views ``[blocks, heads, block_size, 2 * head_dim]`` over one allocation, layer outermost:
    the heads before the tokens (vLLM's LBHNC), or the tokens before the heads (LBNHC, what a decode of
    another TP size pairs with)."""
    if tokens_outermost:
        buf = torch.zeros(layers, num_blocks, BLOCK, heads, 2 * HEAD_DIM, dtype=torch.bfloat16, device=device)
        return {f"model.layers.{i}.self_attn.attn": buf[i].permute(0, 2, 1, 3) for i in range(layers)}
    buf = torch.zeros(layers, num_blocks, heads, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16, device=device)
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(layers)}


def _content(layer: int, num_blocks: int, heads: int, device: torch.device, rank: int = 0) -> torch.Tensor:
    """What prefill rank ``rank`` holds in ``layer``: ``[blocks, heads, block_size, 2 * head_dim]``."""
    gen = torch.Generator(device=device).manual_seed(1000 + layer + 7919 * rank)
    return torch.randn((num_blocks, heads, BLOCK, 2 * HEAD_DIM), generator=gen, device=device).to(torch.bfloat16)


def role_main(args: argparse.Namespace) -> None:
    """One side of the transfer benchmark (``--role``), driven through files in ``--dir``."""
    from kvplan.integrations.vllm.scheduler import ReceiveRequest, SchedulerStep, SendRequest
    from kvplan.integrations.vllm.worker import ConnectorWorker

    import faulthandler
    import logging

    logging.basicConfig(level=logging.INFO, format=f"{args.role} %(asctime)s %(threadName)s %(message)s")
    if args.limit_s > 15:  # (a stuck run says where each thread is, before its parent kills it)
        faulthandler.dump_traceback_later(args.limit_s - 10, exit=False)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    heads, layers, pool = args.heads, args.layers, args.pool
    src_tp, dst_tp = args.tp
    tp_size = src_tp if args.role == "prefill" else dst_tp
    rank = args.rank
    from kvplan.integrations.vllm.groups import KVGroup

    my_heads = heads if args.role == "prefill" else heads * src_tp // dst_tp
    caches = _caches(my_heads, pool, layers, device, tokens_outermost=args.layout == "LBNHC")
    groups = ()
    if args.window:  # a sliding-window group over the same memory, layer for layer (vLLM overlays groups)
        window_caches = {name.replace("self_attn", "window_attn"): view for name, view in caches.items()}
        groups = (KVGroup(tuple(caches)), KVGroup(tuple(window_caches), args.window))
    worker = ConnectorWorker(_settings(args.port, args.mode, args.warm_up == "on", tp_size, args.engine), args.role, rank, tp_size,
                             BLOCK, max_model_len=1 << 16, sends=args.role == "prefill",
                             receives=args.role == "decode", groups=groups)
    worker.register_kv_caches({**caches, **window_caches} if args.window else caches)
    served = range(rank * dst_tp // src_tp, rank * dst_tp // src_tp + max(1, dst_tp // src_tp))  # (prefill) its decodes
    rounds = json.load(open(os.path.join(args.dir, "rounds.json")))
    out = []
    if args.role == "prefill":
        for layer, name in enumerate(caches):
            caches[name].copy_(_content(layer, pool, heads, device, rank))
        _sync(device)
        for k, spec in enumerate(rounds):
            names = [f"k{k}-r{r}" for r in range(len(spec["src"]))]
            worker.start_load_kv(SchedulerStep(send={n: SendRequest(_blocks(spec, "src", r), spec["tokens"])
                                                     for r, n in enumerate(names)}))
            _touch(args.dir, f"sending-{k}")
            sent, finished, deadline = set(), set(names), time.monotonic() + 300
            while sent != set(names) and time.monotonic() < deadline:
                sent |= worker.get_transfer_results(finished).finished_sending
                finished = set()
            for d in served:
                _wait(args.dir, f"done-{k}-{d}", worker)
            out.append({"round": k, "sent": len(sent)})
    else:
        for k, spec in enumerate(rounds):
            _wait(args.dir, f"sending-{k}", None)
            names = [f"k{k}-r{r}" for r in range(len(spec["dst"]))]
            step = SchedulerStep(receive={f"d-{n}": ReceiveRequest(_blocks(spec, "dst", r), spec["tokens"], "prefill",
                                                                    n, "127.0.0.1", args.peer_port, src_tp)
                                          for r, n in enumerate(names)})
            _sync(device)
            start = time.perf_counter()
            worker.start_load_kv(step)
            published = time.perf_counter()
            got, failed, deadline = set(), set(), time.monotonic() + 300
            while len(got) < len(names) and time.monotonic() < deadline:
                results = worker.get_transfer_results(set())
                got |= results.finished_recving
                failed |= results.failed_recving
            took = time.perf_counter() - start
            wrong = 0
            for layer, name in enumerate(caches):  # every byte of every block of every layer (of this rank's heads)
                expected = _expected(layer, pool, heads, device, args.tp, rank)
                for key in ("", "_w") if args.window else ("",):  # (and each window's blocks, over the same memory)
                    src = torch.tensor([b for blocks in spec["src" + key] for b in blocks if b], device=device)
                    dst = torch.tensor([d for blocks, theirs in zip(spec["dst" + key], spec["src" + key])
                                        for d, b in zip(blocks, theirs) if b], device=device)
                    wrong += int((caches[name][dst] != expected[src]).any(dim=(1, 2, 3)).sum())
            caches_zero = [c.zero_() for c in caches.values()]  # (the next round must land again)
            del caches_zero
            _sync(device)
            _touch(args.dir, f"done-{k}-{args.rank}")
            out.append({"round": k, "ms": took * 1e3, "publish_ms": (published - start) * 1e3, "received": len(got),
                        "failed": len(failed), "wrong_blocks": wrong})
    worker.shutdown()
    print(json.dumps(out), flush=True)


def _blocks(spec: dict, side: str, r: int) -> tuple[list[int], ...]:
    """Request ``r``'s block lists on ``side`` (``src`` or ``dst``): the full-attention group's, and the
    sliding-window group's where the round has one."""
    return (spec[side][r], spec[side + "_w"][r]) if side + "_w" in spec else (spec[side][r],)


def _expected(layer: int, pool: int, heads: int, device: torch.device, tp: tuple[int, int], rank: int) -> torch.Tensor:
    """What decode rank ``rank`` must hold in ``layer``: its heads of the prefill rank that holds them, or,
    gathered from several (a prefill of a larger TP), theirs side by side."""
    src_tp, dst_tp = tp
    if src_tp > dst_tp:
        k = src_tp // dst_tp
        return torch.cat([_content(layer, pool, heads, device, r) for r in range(rank * k, rank * k + k)], dim=1)
    mine = heads * src_tp // dst_tp
    first = rank * mine % heads
    return _content(layer, pool, heads, device, rank * src_tp // dst_tp)[:, first : first + mine]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _touch(folder: str, name: str) -> None:
    open(os.path.join(folder, name), "w").close()


def _wait(folder: str, name: str, worker, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(folder, name)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} never came")
        if worker is not None:
            worker.get_transfer_results(set())  # (keeps answering its decode)
        time.sleep(0.001)


def transfer_rows(heads: int, requests: int, tokens: int, fragmented: bool, mode: str, repeats: int,
                  layers: int, limit_s: float = 240.0, warm_up: str = "on", tp: tuple[int, int] = (1, 1),
                  layout: str = "LBHNC", window: int = 0, engine: str = "nixl") -> dict:
    """One batch shape moved ``repeats`` times between the ranks of a prefill of TP ``tp[0]`` (``heads``
    KV heads each) and of a decode of TP ``tp[1]`` that exchange it: prefill rank 0 and the decode ranks
    it serves, or decode rank 0 and the prefill ranks it gathers from; each a process of its own."""
    blocks_each = tokens // BLOCK
    groups = 2 if window else 1  # (a sliding-window group's blocks come from the same pool)
    pool = requests * blocks_each * 2 * groups
    skipped = max(0, tokens - window + 1) // BLOCK if window else 0  # (blocks vLLM frees before the window)
    rng = np.random.default_rng(11)
    rounds = []
    for _ in range(repeats):
        src = allocate(requests * groups, blocks_each, pool, fragmented, rng)
        dst = allocate(requests * groups, blocks_each, pool, fragmented, rng)
        rounds.append({"src": src[:requests], "dst": dst[:requests], "tokens": tokens})
        if window:
            rounds[-1].update(src_w=[[0] * skipped + b[skipped:] for b in src[requests:]], dst_w=dst[requests:])
    with tempfile.TemporaryDirectory() as folder:
        json.dump(rounds, open(os.path.join(folder, "rounds.json"), "w"))
        decodes, prefills = max(1, tp[1] // tp[0]), max(1, tp[0] // tp[1])
        base_port = free_span(prefills)  # (prefill rank r listens at its engine's port + r)
        ports = free_ports(decodes)
        base = [sys.executable, "-m", "benchmarks.vllm_shapes", "--dir", folder, "--heads", str(heads), "--layers",
                str(layers), "--pool", str(pool), "--mode", mode, "--warm-up", warm_up, "--tp", str(tp[0]), str(tp[1]),
                "--layout", layout, "--window", str(window), "--engine", engine, "--limit-s", str(limit_s)]
        senders = [subprocess.Popen(base + ["--role", "prefill", "--rank", str(r), "--port", str(base_port)],
                                    stdout=subprocess.PIPE, text=True, cwd=ROOT) for r in range(prefills)]
        ranks = []
        try:
            ranks = [subprocess.Popen(base + ["--role", "decode", "--rank", str(d), "--port", str(ports[d]),
                                              "--peer-port", str(base_port)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=ROOT) for d in range(decodes)]
            outputs = [rank.communicate(timeout=limit_s) for rank in ranks]
            for sender in senders:
                sender.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # (a mode that cannot move the batch in time: reported with its bound)
            for rank in ranks:  # (what the decode ranks said: the reason is theirs to give)
                rank.kill()
                print(f"a decode rank did not end within {limit_s:.0f} s; its last words:\n"
                      f"{rank.communicate(timeout=10)[1][-3000:]}", file=sys.stderr, flush=True)
            return {"heads": heads, "requests": requests, "tokens": tokens, "layers": layers, "mode": mode, "tp": tp,
                    "layout": layout,
                    "placement": "fragmented" if fragmented else "contiguous", "timed_out_s": limit_s}
        finally:
            for proc in [*senders, *ranks]:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
    for rank, (_, err) in zip(ranks, outputs):
        if rank.returncode != 0:
            raise RuntimeError(err[-2000:])
    by_rank = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    # a round ends once every decode rank has its part: the slowest rank's time
    per_round = [{**rows[0], "ms": max(r["ms"] for r in rows), "publish_ms": max(r["publish_ms"] for r in rows),
                  "wrong_blocks": sum(r["wrong_blocks"] for r in rows), "failed": sum(r["failed"] for r in rows)}
                 for rows in zip(*by_rank)]
    steady = [r["ms"] for r in per_round[1:]] or [per_round[0]["ms"]]
    nbytes = requests * (2 * blocks_each - skipped if window else blocks_each) * layers * heads * prefills * BLOCK \
        * 2 * HEAD_DIM * 2
    return {"heads": heads, "tp": tp, "layout": layout, "window": window, "requests": requests, "tokens": tokens,
            "layers": layers,
            "placement": "fragmented" if fragmented else "contiguous", "mode": mode, "engine": engine,
            "warm_up": warm_up, "first_ms": per_round[0]["ms"], "first_pairing_ms": per_round[0]["publish_ms"],
            "steady_ms": statistics.median(steady), "gib_s": nbytes / statistics.median(steady) / 1e6 / 1.073741824,
            "bytes": nbytes, "wrong_blocks": sum(r["wrong_blocks"] for r in per_round),
            "failed": sum(r["failed"] for r in per_round), "rounds": per_round}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--no-transfer", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", nargs="*", default=list(BATCHES), help=f"of {list(BATCHES)}")
    parser.add_argument("--no-plan", action="store_true")
    # (one side of the transfer benchmark)
    parser.add_argument("--role", choices=("prefill", "decode"))
    parser.add_argument("--dir")
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--pool", type=int)
    parser.add_argument("--mode", default="auto")
    parser.add_argument("--modes", nargs="*", default=["prepared", "direct", "staged"])
    parser.add_argument("--engine", default="nixl", help="the connector's engine (nixl, mooncake, ipc)")
    parser.add_argument("--limit-s", type=float, default=240.0, help="how long one batch shape's processes may run")
    parser.add_argument("--placements", nargs="*", default=["fragmented", "contiguous"])
    parser.add_argument("--warm-up", choices=("on", "off"), default="on",
                        help="the connector's warm_up setting (default on: its default)")
    parser.add_argument("--port", type=int)
    parser.add_argument("--peer-port", type=int)
    parser.add_argument("--tp", type=int, nargs=2, default=(1, 1), metavar=("PREFILL", "DECODE"),
                        help="TP sizes: 4 8 moves prefill rank 0's two heads of 8 to decode ranks 0 and 1; "
                             "8 4 gathers prefill ranks 0 and 1's head each into decode rank 0")
    parser.add_argument("--rank", type=int, default=0, help="(one side) its TP rank")
    parser.add_argument("--window", type=int, default=0,
                        help="a sliding-window group of this many tokens over the same layers' memory (vLLM's hybrid "
                             "KV cache manager): each request's window blocks move too")
    parser.add_argument("--layout", choices=("LBHNC", "LBNHC"), default="LBHNC",
                        help="how both sides lay a layer's blocks out: the heads outside the tokens (LBHNC, vLLM's "
                             "NIXL connector's) or inside (LBNHC, kvplan's connector's default)")
    args = parser.parse_args()
    if args.role:
        role_main(args)
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    card = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter: no speed measured)"
    result = {"card": card, "plan": [], "transfer": []}
    for row in ([] if args.no_plan else plan_rows(args.scale, args.runs, device)):
        result["plan"].append({**row.__dict__, "speedup": row.speedup})
        print(f"plan {row.shape:13s} {row.batch:6s} {row.placement:10s} descs vllm {row.descriptors_vllm:>8d} direct "
              f"{row.descriptors_direct:>8d}  vllm-host {row.vllm_host_ms:8.3f} ms  kvplan-prepared "
              f"{row.kvplan_prepared_ms:7.3f} ms ({row.speedup:5.1f}x)  kvplan-direct {row.kvplan_direct_ms:7.3f} ms",
              flush=True)
    if not args.no_transfer:
        batches = [BATCHES[b] for b in args.batches] if device.type == "cuda" else [(2, 64)]  # (a CPU: a smoke run)
        layers = LAYERS if device.type == "cuda" else 2
        src_tp, dst_tp = args.tp
        heads = 1 if src_tp == dst_tp else 8 // src_tp  # (TP 8's one head; else Llama-70B's 8 over the prefill's ranks)
        modes = args.modes if device.type == "cuda" else [m for m in ("prepared", "direct") if m in args.modes]
        for requests, tokens in batches:
            for fragmented in [p == "fragmented" for p in args.placements]:
                for mode in modes:
                    if mode == "prepared" and src_tp != dst_tp and args.layout == "LBNHC":
                        continue  # (prepared lists are per page: head slices of each token have none)
                    row = transfer_rows(heads, requests, tokens, fragmented, mode, args.repeats, layers,
                                        warm_up=args.warm_up, tp=(src_tp, dst_tp), layout=args.layout,
                                        window=args.window, engine=args.engine, limit_s=args.limit_s)
                    result["transfer"].append(row)
                    if "timed_out_s" in row:
                        print(f"move {requests}x{tokens} {row['placement']:10s} {mode:8s} did not end within "
                              f"{row['timed_out_s']:.0f} s", flush=True)
                        continue
                    print(f"move {args.engine} tp{src_tp}to{dst_tp} {args.layout} window {args.window} {requests}x{tokens} {row['placement']:10s} {mode:8s} warm-up {args.warm_up:3s} first "
                          f"{row['first_ms']:9.1f} ms (pairing {row['first_pairing_ms']:7.1f}) "
                          f"steady {row['steady_ms']:9.1f} ms  {row['gib_s']:7.2f} GiB/s  wrong {row['wrong_blocks']} "
                          f"failed {row['failed']}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tag = f"-{'-'.join(args.batches)}-warm-{args.warm_up}" if args.no_plan else ""
        tag += f"-tp{args.tp[0]}to{args.tp[1]}-{args.layout}" if args.tp[0] != args.tp[1] else ""
        tag += f"-window{args.window}" if args.window else ""
        tag += f"-{args.engine}" if args.engine != "nixl" else ""
        with open(os.path.join(args.out, f"vllm_shapes{tag}.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
