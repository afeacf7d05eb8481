"""The CPU a waiting endpoint burns (target: under 5% of a core when idle).

A decode endpoint waits on a request that never arrives, with one sender and with two (fan-in),
over real control channels on loopback and a real engine. Two figures per case, over the same
wall time:

* the waiting thread's own CPU (``RUSAGE_THREAD``): what kvplan's loop costs;
* the whole process's CPU: with NIXL's progress thread on, NIXL itself spins a core whatever
  kvplan does (``progress_thread=False`` turns it off; kvplan's loops then progress the worker).

Run: ``python -m benchmarks.probes.idle_cpu [--seconds 3] [--json out.json]`` (CPU; engines as installed).

Answer (this CPU machine, session 22, results/archive/2026-11-28-cpu-session22-idle/): a waiting decode endpoint's own thread uses 2.2-2.6% of a core (it spun a whole core before); NIXL's own progress thread spins a core whatever kvplan does.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

from kvplan.planner.device.destinations import PreallocatedRequest, plan_destinations
from kvplan.planner.contract.batch import Attention, Entry, KVLayout, SideMemory
from kvplan.transport.control import ControlChannel
from kvplan.transport.decode import DecodeEndpoint
from kvplan.transport.engines import make_engine
from tests.planner.builders import table_with


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def idle_decode(engine: str, senders: int, seconds: float, **settings) -> dict:
    pool = torch.zeros(16 * 256, dtype=torch.uint8)
    side = SideMemory(KVLayout(Attention.MLA, 4, (Entry(pool.data_ptr(), 256, 16),)),
                      req_to_token=table_with({1: [3, 4]}, 4, max_ctx=16))
    channels = [ControlChannel(host="127.0.0.1") for _ in range(senders)]
    peers = [ControlChannel(c.port, host="127.0.0.1") for c in channels]
    try:
        endpoint = DecodeEndpoint(side, make_engine(engine, f"idle-{engine}-{senders}", **settings), channels)
        endpoint.track(plan_destinations(side, [PreallocatedRequest("r1", row=1, prompt_len=8)]).result(),
                       time.monotonic() + seconds)
        time.sleep(0.2)  # let the engine's threads settle
        wall, thread, process = time.monotonic(), _cpu(resource.RUSAGE_THREAD), _cpu(resource.RUSAGE_SELF)
        endpoint.wait()
        wall = time.monotonic() - wall
        endpoint.engine.close()
        return {"engine": engine, "senders": senders, **settings, "seconds": round(wall, 2),
                "thread_core_share": round((_cpu(resource.RUSAGE_THREAD) - thread) / wall, 4),
                "process_core_share": round((_cpu(resource.RUSAGE_SELF) - process) / wall, 4)}
    finally:
        for c in channels + peers:
            c.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    cases = [("nixl", 1, {}), ("nixl", 2, {}), ("nixl", 1, {"progress_thread": False}),
             ("nixl", 2, {"progress_thread": False}), ("mooncake", 1, {"local_hostname": "127.0.0.1"}),
             ("mooncake", 2, {"local_hostname": "127.0.0.1"})]
    rows = []
    for engine, senders, settings in cases:
        try:
            rows.append(idle_decode(engine, senders, args.seconds, **settings))
        except ImportError as err:
            rows.append({"engine": engine, "senders": senders, **settings, "skipped": str(err)})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
