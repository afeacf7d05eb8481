"""Question: reading how ``kvplan.plan(batch)`` builds a planner and queues a plan, how many times
does a newcomer open a file of the planner, and how often one they have already read?

Every call between two files of ``kvplan/planner/`` made during the first ``plan(batch)`` of a
fresh process (the planner is built, then queues the plan) is traced: the construction path, up to
the call's return. An *entry* is the first call from one file into another (the reader follows it once,
however often it runs, into whichever of the file's functions); a *return* is an entry into a file
the walk already entered. Calls into kernels, errors and the standard library are not counted, nor
calls that Python makes on the code's behalf (a cached property's first read).

Run on the CPU: ``TRITON_INTERPRET=1 python -m benchmarks.probes.plan_walk [--list]``.

Answer (this CPU machine, `llama70b-tp8-p64` at 4 layers): the flat planner (commit 6af866f) entered
7 files 7 times, none a return; the planner in rooms, its device planner split into a planner, static
tables, buffers and pending plans, enters 10 files 11 times, 1 of them a return (the buffers and the
tables share the tensor helpers of ``device/lists.py``). By this count the split made the walk longer;
each file it enters now holds one role.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

_PLANNER = str(Path(__file__).resolve().parents[2] / "kvplan" / "planner")


def entries(fn) -> list[tuple[str, str, str, str]]:
    """The first call from each file into each other file of the planner made while ``fn()`` runs,
    in order: ``(caller file, caller function, callee file, callee function)``."""
    seen: dict[tuple[str, str], tuple[str, str, str, str]] = {}
    user = sys._getframe(1).f_code.co_filename

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = frame.f_code.co_filename
        caller = frame.f_back.f_code.co_filename if frame.f_back else ""
        if callee.startswith(_PLANNER) and caller != callee and (caller.startswith(_PLANNER) or caller == user):
            short = lambda f: os.path.relpath(f, os.path.dirname(_PLANNER)) if f.startswith(_PLANNER) else "(caller)"  # noqa: E731
            seen.setdefault((caller, callee), (short(caller), frame.f_back.f_code.co_name, short(callee),
                                               frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return list(seen.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="llama70b-tp8-p64")
    parser.add_argument("--list", action="store_true", help="print each entry")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")

    import kvplan.planner  # noqa: F401  (registers the state kinds before the walk)
    from kvplan.tools.scenarios import PRESETS, build_batch

    try:
        from kvplan import plan
    except ImportError:  # (a tree before kvplan exported it)
        from kvplan.planner.gpu import plan
    batch = build_batch(PRESETS[args.scenario].scaled(layers=4), requests=2, prompt_len=1000)
    walk = entries(lambda: plan(batch))
    read: set[str] = set()
    returns = 0
    for caller, caller_fn, callee, callee_fn in walk:
        returns += callee in read
        read.add(callee)
        if args.list:
            print(f"{caller}:{caller_fn} -> {callee}:{callee_fn}")
    print(f"{len(read)} files, {len(walk)} entries, {returns} returns")


if __name__ == "__main__":
    main()
