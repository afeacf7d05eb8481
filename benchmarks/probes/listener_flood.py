"""A listener's process under a flood from processes that never prove the secret (issue 79): its memory and
descriptors before, during and after, and whether honest decodes pair meanwhile. On a CPU (loopback):

    python -m benchmarks.probes.listener_flood [--idle 2000] [--sources 64] [--hellos 8] [--frames 4]

The listener runs in a child process of its own, calling ``accept_pending`` every 10 ms as an integration's
poll does, and reports its resident memory (``VmRSS``) and open descriptors on request. The flood, from this
process: ``--idle`` raw TCP connections that never speak, ``--sources`` loopback addresses saying ``--hellos``
hellos each and nothing more, and ``--frames`` frames of 64 MiB. Then ten decodes ask for a channel, pair
(the loopback secret) and register, one after another, while the hellos go on. One JSON line. For a baseline,
run it with ``PYTHONPATH`` naming an older tree's ``kvplan`` (``connections``/``evicted`` are then ``null``).

Answer (2026-12-08, this project's 2-core CPU machine; benchmarks/results/2026-12-08-cpu-listener-flood/): 10 of
10 honest decodes paired under the flood (0 of 10 before the bounds, each answered "busy"); ~300 descriptors
steady, 538-558 at the flood's height (2,612 steady before, never released); within ~30 MiB of idle memory.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import time

import zmq

from kvplan.errors import KvplanError
from kvplan.transport.listener import ChannelListener, channel_via


def _usage() -> dict:
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"rss_mib": round(rss / 1024, 1), "fds": len(os.listdir("/proc/self/fd"))}


def _serve(conn, handshake_s: float) -> None:
    listener = ChannelListener(0, host="127.0.0.1", handshake_s=handshake_s)
    conn.send(listener.port)
    handed = 0
    while True:
        for channel in listener.accept_pending():
            channel.recv(time.monotonic() + 5)  # (its registration)
            channel.close()
            handed += 1
        if conn.poll(0.01):
            asked = conn.recv()
            if asked == "bye":
                break
            bound = getattr(listener, "connections", None)  # (a listener before its bounds has none: a baseline)
            conn.send({**_usage(), "handed_out": handed, "pending": len(listener.pending),
                       "connections": None if bound is None else len(bound), "evicted": getattr(listener, "evicted", None),
                       "busy": listener.refused_busy})
    listener.close()


def _hellos(source: str, port: int, count: int) -> list:
    sockets = []
    for _ in range(count):
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://{source}:0;127.0.0.1:{port}")
        s.send_multipart([json.dumps({"kind": "hello"}).encode()])
        sockets.append(s)
    return sockets


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--idle", type=int, default=2000)
    parser.add_argument("--sources", type=int, default=64)
    parser.add_argument("--hellos", type=int, default=8)
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--handshake-s", type=float, default=5.0)
    args = parser.parse_args()
    here, there = multiprocessing.Pipe()
    server = multiprocessing.get_context("spawn").Process(target=_serve, args=(there, args.handshake_s))
    server.start()
    sockets, raw, report = [], [], {}
    try:
        port = here.recv()

        def ask(stage: str) -> None:
            here.send("usage")
            report[stage] = here.recv()

        time.sleep(0.5)
        ask("before")
        raw = [socket.create_connection(("127.0.0.1", port)) for _ in range(args.idle)]
        for k in range(args.sources):
            sockets += _hellos(f"127.0.{4 + k // 250}.{1 + k % 250}", port, args.hellos)
        for _ in range(args.frames):
            big = zmq.Context.instance().socket(zmq.DEALER)
            big.setsockopt(zmq.LINGER, 0)
            big.connect(f"tcp://127.0.0.1:{port}")
            big.send(b"x" * (64 << 20), copy=False)
            sockets.append(big)
        time.sleep(1.0)
        ask("flooded")
        paired, started, honest = 0, time.monotonic(), []
        for k in range(10):
            sockets += _hellos(f"127.0.{4 + k % 4}.{1 + k}", port, args.hellos)  # (the flood goes on)
            try:
                channel = channel_via("127.0.0.1", port, timeout=10)
                channel.send("register", {"n": k}, timeout=10)
            except KvplanError as err:  # (answered "busy", or never paired)
                report.setdefault("honest_refused", []).append(f"{type(err).__name__}: {str(err)[:120]}")
                continue
            honest.append(channel)  # (open until the listener has handed it out)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                ask("pairing")
                if report["pairing"]["handed_out"] >= len(honest):
                    paired += 1
                    break
        report.pop("pairing", None)
        report["honest"] = {"handed_out": paired, "of": 10, "s": round(time.monotonic() - started, 2)}
        for channel in honest:
            channel.close()
        ask("after_pairings")
        time.sleep(args.handshake_s + 1)
        ask("after_handshake_s")
        time.sleep(args.handshake_s)
        ask("after_twice_handshake_s")
    finally:
        for s in sockets:
            s.close()
        for c in raw:
            c.close()
        here.send("bye")
        server.join(30)
        if server.is_alive():
            server.kill()
            server.join()
    print(json.dumps({"idle": args.idle, "sources": args.sources, "hellos": args.hellos,
                      "frames_of_64_mib": args.frames, **report}))


if __name__ == "__main__":
    main()
