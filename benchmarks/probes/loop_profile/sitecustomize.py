"""Host time per transport step inside the two demo processes (a diagnostic, not a benchmark).

With this folder first on ``PYTHONPATH`` and ``LOOP_PROF=1``, every process that imports
``kvplan.tools.demo`` (the demo and its spawned prefill and decode processes) wraps the transport's
loop steps, the planner's host calls and the copy launch with a timer. Each process writes
``loop-<pid>.txt`` into ``LOOP_PROF_OUT`` (default /tmp): per step its calls, total, median, p90 and
maximum. The decode writes after each ``wait``, the prefill before each ``receive_requests``, so the
writing stays outside a send's timed span. Each wrapped call costs ~1-2 us.

    LOOP_PROF=1 LOOP_PROF_OUT=/tmp/prof PYTHONPATH=benchmarks/probes/loop_profile:. python3 -m kvplan demo ...
"""

import collections
import functools
import importlib.abc
import importlib.machinery
import os
import sys
import time

STATS = collections.defaultdict(lambda: [0, 0.0, 0.0, []])  # name: calls, total s, max s, first 20k times


def _timed(fn, key):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            s = STATS[key]
            s[0], s[1], s[2] = s[0] + 1, s[1] + dt, max(s[2], dt)
            if len(s[3]) < 20000:
                s[3].append(dt)
    return timed


def dump() -> None:
    import numpy as np

    with open(os.path.join(os.environ.get("LOOP_PROF_OUT", "/tmp"), f"loop-{os.getpid()}.txt"), "w") as out:
        for key, (n, total, most, times) in sorted(STATS.items(), key=lambda kv: -kv[1][1]):
            us = np.array(times) * 1e6
            out.write(f"{key:45s} n={n:8d} total={total * 1e3:9.2f} ms  median={np.median(us):8.1f} us  "
                      f"p90={np.percentile(us, 90):8.1f} us  max={most * 1e6:9.1f} us\n")


def install() -> None:
    from kvplan.kernels import copy as kc
    from kvplan.planner.device import columns
    from kvplan.planner.device import buffers, pending, planner
    from kvplan.transport import completion, control, decode, prefill, receiver_plan
    from kvplan.transport.engines import nixl
    from kvplan.transport.senders import staged

    steps = {
        staged.StagedRun: ("_pump", "_wait", "_gather", "_post", "announce", "move", "__init__"),
        prefill.PrefillEndpoint: ("_peer_gone", "_gather_ahead", "_announce_chunks", "_alignment", "_move"),
        decode.DecodeEndpoint: ("poll", "_advance_runs", "_scatter_landed", "_finish_scatters", "_scatter",
                                "_announce_planned", "_on_run_waves", "_start_waves", "publish", "track", "_credit"),
        receiver_plan.PlannedRun: ("announce", "advance", "_place", "scatter_inputs"),
        planner.Planner: ("plan", "_launch", "_columns", "_next_slot"),
        pending.PendingPlan: ("device_ahead", "sections", "section_byte_ends", "transfer_rows", "descriptors",
                             "device_descriptors", "_head"),
        buffers.Buffers: ("fill",),
        columns.BatchColumns: ("from_batch",),
        completion.CompletionTracker: ("check_deadlines", "settled", "on_section"),
        control.ControlChannel: ("try_recv", "wait_readable", "peer_gone", "replaced", "send"),
        nixl.NixlEngine: ("notifications", "progress", "post", "notify"),
    }
    for owner, names in steps.items():
        for name in names:
            if hasattr(owner, name):
                setattr(owner, name, _timed(getattr(owner, name), f"{owner.__name__}.{name}"))
    for module, name in ((receiver_plan, "run_columns"), (kc, "copy_descriptors")):
        setattr(module, name, _timed(getattr(module, name), f"{module.__name__.rsplit('.', 1)[-1]}.{name}"))

    waited = decode.DecodeEndpoint.wait

    def wait(*args, **kwargs):
        states = waited(*args, **kwargs)
        dump()
        return states

    receive = prefill.PrefillEndpoint.receive_requests

    def receive_requests(*args, **kwargs):
        dump()
        return receive(*args, **kwargs)

    decode.DecodeEndpoint.wait, prefill.PrefillEndpoint.receive_requests = wait, receive_requests


class _InstallAfterDemo(importlib.abc.MetaPathFinder):
    """Installs the timers once ``kvplan.tools.demo`` (which imports the transport) has loaded."""

    def find_spec(self, name, path, target=None):
        if name != "kvplan.tools.demo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            install()

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("LOOP_PROF"):
    sys.meta_path.insert(0, _InstallAfterDemo())
