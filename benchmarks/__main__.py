"""``python -m benchmarks SUITE [SUITE ...]``: the one entry point of the GPU benchmarks.

On a GPU machine, over a checkout with the engine's cp312 wheels carried (``.whl``: NIXL and pyzmq;
``.whl-mc``: Mooncake and pyzmq), each suite (:mod:`benchmarks.suites`) installs its wheels into
``/tmp/site``, then runs its steps one after another, each under its deadline, and writes into its
folder (``--out``, default ``benchmarks/results/<date>-<card>-<suite>/``):

* ``card.txt``: the cards, the driver, torch and triton;
* ``NN-<step>.txt``: each step's command and its whole output;
* ``suite.json``: each step's command, exit code and seconds.

Runs bind loopback only (``UCX_NET_DEVICES=lo``): these machines reach nothing but themselves. Kernels
are compiled (``TRITON_INTERPRET=0``).

    python -m benchmarks --list
    python -m benchmarks e2e-nixl vllm --out /tmp/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tarfile
import time

from .suites import SUITES, Suite

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = "/tmp/site"
ARCHIVE_SITE = "/tmp/site-archive"  # where a suite's archive of packages is unpacked (after SITE on the path)
ENV = {"TRITON_INTERPRET": "0", "PYTHONUNBUFFERED": "1", "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN",
       "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535"}
TAIL = 12  # lines of each step's output shown on the terminal


def card() -> str:
    """The cards, driver, torch and triton, as ``card.txt`` holds them."""
    lines = []
    try:
        lines.append(subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30).stdout.strip())
    except (OSError, subprocess.TimeoutExpired) as err:
        lines.append(f"no nvidia-smi: {err}")
    import torch
    import triton

    lines.append(f"torch {torch.__version__} triton {triton.__version__}")
    return "\n".join(lines) + "\n"


def install(wheels: str, site: str = "") -> dict[str, str]:
    """The environment of every step, once the suite's wheels are in ``SITE`` and its archive of packages
    (``site``, a ``.tar.xz``) is unpacked into ``ARCHIVE_SITE``."""
    folder = os.path.join(ROOT, wheels)
    found = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".whl")) \
        if os.path.isdir(folder) else []
    if not found:
        raise SystemExit(f"no wheels in {wheels}/: carry the engine's cp312 wheel and pyzmq's there")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", SITE, *found], check=True, timeout=300)
    path = [ROOT, SITE]
    if site:
        archive = os.path.join(ROOT, site)
        if not os.path.isfile(archive):
            raise SystemExit(f"no {site}: carry it (the suite's about says what makes it)")
        os.makedirs(ARCHIVE_SITE, exist_ok=True)
        with tarfile.open(archive) as tar:
            tar.extractall(ARCHIVE_SITE, filter="data")
        path.append(ARCHIVE_SITE)
    return {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join(path)}


def run_suite(name: str, suite: Suite, out: str) -> list[dict]:
    os.makedirs(out, exist_ok=True)
    env = install(suite.wheels, suite.site)
    with open(os.path.join(out, "card.txt"), "w") as f:
        f.write(card())
    rows = []
    for k, step in enumerate(suite.steps, 1):
        command = step.command(out)
        log = os.path.join(out, f"{k:02d}-{step.name}.txt")
        start = time.monotonic()
        with open(log, "w") as f:
            f.write("$ " + " ".join(f"{key}={value}" for key, value in step.env.items()) + " " * bool(step.env)
                    + " ".join(command) + "\n")
            f.flush()
            try:
                rc = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env={**env, **step.env},
                                    timeout=step.timeout_s).returncode
            except subprocess.TimeoutExpired:
                rc = 124
                f.write(f"\n(stopped at its deadline of {step.timeout_s:.0f} s)\n")
        took = time.monotonic() - start
        rows.append({"step": step.name, "command": command, "env": step.env, "rc": rc, "seconds": round(took, 1)})
        print(f"[{name}] {k}/{len(suite.steps)} {step.name}: exit {rc} in {took:.1f} s ({log})", flush=True)
        with open(log) as f:
            for line in f.readlines()[-TAIL:]:
                print("    " + line.rstrip(), flush=True)
    with open(os.path.join(out, "suite.json"), "w") as f:
        json.dump({"suite": name, "about": suite.about, "steps": rows}, f, indent=1)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("suites", nargs="*", metavar="SUITE", help="of --list")
    parser.add_argument("--list", action="store_true", help="the suites, what each measures and needs")
    parser.add_argument("--out", help="the results folder (each suite in a folder of its own below it)")
    args = parser.parse_args(argv)
    if args.list or not args.suites:
        for name, suite in SUITES.items():
            print(f"{name:17s} {suite.gpus} GPU{'s' if suite.gpus > 1 else ' '} {suite.wheels:8s} {suite.about}")
        return 0
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        parser.error(f"unknown suites {unknown}; --list names them")
    import torch

    cards = torch.cuda.device_count()
    slug = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-") if cards else "cpu"
    failed = 0
    for name in args.suites:
        suite = SUITES[name]
        if cards < suite.gpus:
            print(f"[{name}] needs {suite.gpus} GPUs, this machine has {cards}: skipped", flush=True)
            failed += 1
            continue
        folder = os.path.join(args.out, name) if args.out else os.path.join(
            ROOT, "benchmarks", "results", f"{datetime.date.today()}-{slug}-{name}")
        failed += any(row["rc"] != 0 for row in run_suite(name, suite, folder))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
