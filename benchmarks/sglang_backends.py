"""kvplan inside SGLang against SGLang's own transfer backends, on the same requests through SGLang's own
scheduler queues: what the scheduler thread spends per step in the queues' and the backend's calls, and
how fast the requests go.

Each run is one prefill and one decode process of ``tests/integrations/sglang_scheduler_node.py``
(SGLang 0.5.23's ``PrefillBootstrapQueue``, ``send_kv_chunk``, ``DecodePreallocQueue`` and
``DecodeTransferQueue`` over SGLang's own pools; the forward pass is a stand-in that writes each chunk's
KV), once with kvplan's adapter (``KVPLAN_SGLANG=1``) and once with SGLang's own backend, for each of
Mooncake and NIXL, and kvplan's ``ipc`` engine (``KVPLAN_ENGINE=ipc``: the GPU writes the decode's
pages itself). Every request's KV is checked on the decode; a run whose requests did not all arrive is
reported, not timed. A step's time counts only SGLang's calls into its queues (the backend's work on the
scheduler thread), not the stand-in forward pass. Per run: requests/s and KV bytes/s over the decode's
wall time (the bytes past each request's prefix hit), and each request's time from being added to the
decode's queue to decode-ready (p50, p99).

With ``--device cuda`` SGLang's pools live on the GPU (both processes on one card; Mooncake over TCP,
NIXL over UCX, as ``MOONCAKE_PROTOCOL`` and UCX's own settings say) and ``--layers``, ``--heads`` and
``--head-dim`` give the model's shape.

Example::

    python -m benchmarks.sglang_backends --waves 4 --json out/sglang-backends.json
    python -m benchmarks.sglang_backends --device cuda --layers 32 --heads 8 --head-dim 128
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from benchmarks.sides import print_row, run_sides, side_errors
from tests.ports import free_ports

RUNS = (("kvplan", "mooncake"), ("sglang", "mooncake"), ("kvplan", "nixl"), ("sglang", "nixl"), ("kvplan", "ipc"))


def run_pair(adapter: str, backend: str, waves: int, deadline_s: float, shape: list[str] = (), mode: str = "") -> dict:
    """One prefill and one decode rank; each one's JSON line, by role (or ``{"error": ...}``)."""
    bootstrap, prefill_dist, decode_dist = free_ports(3)
    env = {**os.environ, "KVPLAN_HOST": "127.0.0.1", "SGLANG_HOST_IP": "127.0.0.1", "PYTHONWARNINGS": "ignore",
           "KVPLAN_TIMEOUT_S": str(deadline_s), "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    env.pop("KVPLAN_SGLANG", None)
    env.pop("KVPLAN_ENGINE", None)
    env.pop("KVPLAN_MODE", None)
    if adapter == "kvplan":
        env["KVPLAN_SGLANG"] = "1"
    if adapter == "kvplan" and mode:
        env["KVPLAN_MODE"] = mode
    if backend == "ipc":  # SGLang's backend setting names NIXL; kvplan's engine setting overrides it
        env["KVPLAN_ENGINE"], backend = "ipc", "nixl"
    with tempfile.TemporaryDirectory(prefix="kvplan-sglang-backends-") as tmp:
        commands = {}
        for role, dist in (("prefill", prefill_dist), ("decode", decode_dist)):
            commands[role] = [sys.executable, "-m", "tests.integrations.sglang_scheduler_node", role, "--backend",
                              backend, "--bootstrap-port", str(bootstrap), "--dist-port", str(dist), "--waves",
                              str(waves), "--aborts", "0", "--deadline-s", str(deadline_s), "--done-dir", tmp, *shape]
        return run_sides(commands, env, deadline_s + 60)


def row(adapter: str, backend: str, got: dict) -> dict:
    """One run's line of the table: requests that arrived right, the decode's wall time and rate, and each
    side's per-step time; where a side failed, every failing side's error, each named."""
    error = side_errors(got)
    if error:
        return {"adapter": adapter, "backend": backend, "error": error,  # (and what the other side saw)
                "sides": {r: side for r, side in got.items() if "error" not in side}}
    decode = got["decode"]
    outcome = decode["outcome"]
    ok = sum(v == "ok" for v in outcome.values())
    return {"adapter": adapter, "backend": backend, "requests": len(outcome), "ok": ok,
            "decode_s": round(decode["took_s"], 3), "requests_per_s": round(ok / decode["took_s"], 1),
            "kv_bytes": decode["kv_bytes"], "gib_per_s": round(decode["kv_bytes"] / decode["took_s"] / 2**30, 4),
            "ready": decode["ready"], "prefill_step": got["prefill"]["steps"], "decode_step": decode["steps"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waves", type=int, default=4, help="waves of 16 requests (later waves share prefixes)")
    parser.add_argument("--deadline-s", type=float, default=120.0)
    parser.add_argument("--runs", default=",".join(f"{a}-{b}" for a, b in RUNS),
                        help="which of kvplan-mooncake, sglang-mooncake, kvplan-nixl, sglang-nixl")
    parser.add_argument("--device", default="cpu", help="where SGLang's pools live: cpu or cuda")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4, help="the model's KV heads")
    parser.add_argument("--head-dim", type=int, default=8)
    parser.add_argument("--kvplan-mode", default="", help="kvplan's KVPLAN_MODE (default: the adapter's, auto)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    shape = ["--device", args.device, "--layers", str(args.layers), "--heads", str(args.heads),
             "--head-dim", str(args.head_dim)]
    rows = []
    for name in args.runs.split(","):
        adapter, backend = name.split("-")
        rows.append(row(adapter, backend, run_pair(adapter, backend, args.waves, args.deadline_s, shape,
                                                   args.kvplan_mode)))
        if args.json:  # after every run: a call cut short keeps the runs it finished
            with open(args.json, "w") as handle:
                json.dump({"waves": args.waves, "shape": shape, "rows": rows}, handle, indent=1)
        print_row(name, rows[-1])


if __name__ == "__main__":
    main()
