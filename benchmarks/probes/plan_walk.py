"""Question: how many times does constructing and running one plan (``kvplan.planner.device.eager.plan``)
move between the planner's files, and how often does it come back to a file it already left?

A newcomer reading the construction path follows the same walk, so fewer stays and returns mean
fewer files open at once. Every Python call made inside ``kvplan/`` during the first
``eager.plan(batch)`` of a fresh process (the planner is built, then plans) is traced; a *stay* is a
run of consecutive calls in one file, a *return* a stay in a file the walk had already left.

Run on the CPU: ``TRITON_INTERPRET=1 python -m benchmarks.probes.plan_walk [--scenario NAME]``.
Answer (recorded in RESULTS.md, "The planner's construction path"): see the closing note of the
house's issue; the figure printed is the answer for the tree it runs on.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2] / "kvplan"


def walk(fn) -> list[str]:
    """The kvplan files of every Python call made while ``fn()`` runs, in order."""
    files: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(str(_ROOT)):
                files.append(str(Path(name).relative_to(_ROOT.parent)))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return files


def stays(files: list[str]) -> list[str]:
    """``files`` with consecutive repeats merged: one entry per stay."""
    out: list[str] = []
    for f in files:
        if not out or out[-1] != f:
            out.append(f)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="llama70b-tp8-p64")
    parser.add_argument("--all-files", action="store_true", help="count kernels and errors too, not only the planner")
    parser.add_argument("--list", action="store_true", help="print each stay")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")

    from kvplan.planner.device import eager
    from kvplan.tools.scenarios import PRESETS, build_batch

    batch = build_batch(PRESETS[args.scenario].scaled(layers=4), requests=2, prompt_len=1000)
    files = walk(lambda: eager.plan(batch).descriptors())
    if not args.all_files:
        files = [f for f in files if f.startswith("kvplan/planner/")]
    path = stays(files)
    seen: set[str] = set()
    returns = 0
    for f in path:
        returns += f in seen
        seen.add(f)
    if args.list:
        for f in path:
            print(f)
    print(f"{len(seen)} files, {len(path)} stays, {returns} returns")


if __name__ == "__main__":
    main()
