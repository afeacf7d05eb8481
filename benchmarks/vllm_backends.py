"""kvplan's vLLM connector against vLLM's own ``NixlConnector``, on the same requests through the same
engine calls: what the engine's thread spends per step in the connector, and how fast the requests go.

Each run is one prefill and one decode process of ``tests/integrations/vllm_node.py`` (vLLM 0.33.0's
connector factory, both roles, KV caches allocated by vLLM's ``allocate_kv_cache``, the engine loop's
connector calls in vLLM's order; no model), once per connector: kvplan's over NIXL and over Mooncake, and
vLLM's ``NixlConnector`` (real NIXL; it reads the decode's blocks from the prefill). The prefill fills
every block with bytes drawn from its request's name; the decode admits every request at once, steps
until each is reported received, then checks every byte of every block. A run whose requests did not all
arrive right is reported, not timed. Per run: requests/s and KV bytes/s over the decode's wall time (from
admitting the requests to the last one reported received), each request's time from admitted to
received (p50, p99), and each side's step time (every connector call of one engine step).

With ``--device cpu`` (the default) the KV is in host memory, vLLM on its CPU platform. There kvplan's
planning kernels run in Triton's interpreter, synchronously inside the calls that launch them (a card runs
them on its stream): such numbers say nothing of kvplan on a card. With ``--device cuda`` the KV is on the
card (both processes on one), vLLM on its CUDA platform without its compiled extensions (built for torch
2.14; ``benchmarks/vllm_site.py`` packs its Python for the card, suite ``vllm-backends``): no vLLM kernel
runs in either connector's path, and vLLM's attention backend is Triton's.

Example::

    .venv-vllm/bin/python -m benchmarks.vllm_backends --requests 32 --json out/vllm-backends.json
    python -m benchmarks.vllm_backends --device cuda --repeats 3     # on a card, the site on PYTHONPATH
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile

from benchmarks.sides import print_row, run_sides, side_errors
from tests.ports import free_ports

RUNS = (("kvplan", "nixl"), ("kvplan", "mooncake"), ("vllm", "nixl"))


def run_pair(connector: str, engine: str, node_args: list[str], deadline_s: float, mode: str = "",
             device: str = "cpu") -> dict:
    """One prefill and one decode process; each one's JSON line, by role (or ``{"error": ...}``)."""
    prefill_port, decode_port = free_ports(2)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "VLLM_TARGET_DEVICE": device, "HF_HUB_OFFLINE": "1",
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    with tempfile.TemporaryDirectory(prefix="kvplan-vllm-backends-") as tmp:
        commands = {}
        for role, port in (("prefill", prefill_port), ("decode", decode_port)):
            commands[role] = [sys.executable, "-m", "tests.integrations.vllm_node", role, "--port", str(port),
                              "--params", os.path.join(tmp, "params.json"), "--connector",
                              "nixl" if connector == "vllm" else "kvplan", "--engine", engine, "--timeout",
                              str(deadline_s), "--device", device, *node_args]
            if role == "prefill" and connector == "kvplan" and mode:  # (the sender's setting: how it posts)
                commands[role] += ["--mode", mode]
        return run_sides(commands, env, deadline_s + 90)


def row(connector: str, engine: str, got: dict) -> dict:
    """One run's line of the table; where a side failed or a request did not arrive right, why."""
    error = side_errors(got)
    if error:
        return {"connector": connector, "engine": engine, "error": error}
    decode = got["decode"]
    ok = len(set(decode["received"]) - set(decode["failed"]))
    if ok != len(decode["requests"]) or decode["wrong"]:
        return {"connector": connector, "engine": engine, "error": f"{ok} of {len(decode['requests'])} requests "
                f"arrived, {len(decode['wrong'])} blocks wrong: {decode['failed'][:5]} {decode['wrong'][:5]}"}
    wall = decode["wall_s"]
    return {"connector": connector, "engine": engine, "requests": len(decode["requests"]), "ok": ok, "decode_s": wall,
            "requests_per_s": round(ok / wall, 1), "kv_bytes": decode["bytes"],
            "gib_per_s": round(decode["bytes"] / wall / 2**30, 4), "ready": decode["ready"],
            "prefill_step": got["prefill"]["step"], "decode_step": decode["step"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, nargs=2, default=(128, 2048), metavar=("MIN", "MAX"),
                        help="each request's prompt length, drawn uniformly (seeded)")
    parser.add_argument("--shape", type=int, nargs=3, default=(8, 8, 128), metavar=("LAYERS", "HEADS", "HEAD_SIZE"))
    parser.add_argument("--block-size", type=int, default=32, help="(vLLM's CPU attention wants a multiple of 32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--deadline-s", type=float, default=120.0)
    parser.add_argument("--runs", default=",".join(f"{c}-{e}" for c, e in RUNS),
                        help="which of kvplan-nixl, kvplan-mooncake, vllm-nixl")
    parser.add_argument("--device", default="cpu", help="where both sides' KV lives: cpu, or cuda")
    parser.add_argument("--kvplan-mode", default="", help="kvplan's mode on the prefill (default: auto)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rng = random.Random(44)
    lengths = [rng.randint(*args.tokens) for _ in range(args.requests)]
    node_args = ["--layout", "LBNHC", "--block-size", str(args.block_size), "--shape", *map(str, args.shape),
                 "--lengths", *map(str, lengths)]
    rows = []
    for repeat in range(args.repeats):
        for name in args.runs.split(","):
            connector, engine = name.split("-")
            rows.append({"repeat": repeat, **row(connector, engine, run_pair(connector, engine, node_args,
                                                                             args.deadline_s, args.kvplan_mode,
                                                                             args.device))})
            if args.json:  # after every run: a call cut short keeps the runs it finished
                with open(args.json, "w") as handle:
                    json.dump({"lengths": lengths, "node_args": node_args, "device": args.device,
                               "kvplan_mode": args.kvplan_mode or "auto",
                               "rows": rows}, handle, indent=1)
            print_row(name, rows[-1])


if __name__ == "__main__":
    main()
