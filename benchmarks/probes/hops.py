"""One-way latency of a control hop between two processes of one host, by the means kvplan could use:
a shared-memory word (the hardware's floor), ZeroMQ PAIR over TCP loopback with the receiver spinning
(as kvplan's loops do) or blocking, ZeroMQ over a Unix socket, and NIXL's standalone notifications
(``send_notif``, received through ``get_new_notifs``; the progress thread on, as kvplan runs it).

Each figure is half the median of 2,000 round trips (and the p90), after 200 warm-up trips.

    PYTHONPATH=. python3 -m benchmarks.probes.hops            # NIXL skipped where it is not installed

Answer (one H200, session 15, results/archive/): one way, ZeroMQ over TCP loopback 30-41 us back to back but 115 us with trips 2 ms apart (its I/O threads sleep between); NIXL's `send_notif` 9-10 us and 22 us. So the staged path sends its credits through the engine where both sides' engines can.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np

TRIPS, WARM = 2000, 200


def _spin_word(name: str, ping: bool, n: int, out) -> None:
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name=name)
    word = np.ndarray((2,), np.int64, buffer=shm.buf)
    times = []
    for i in range(1, n + 1):
        if ping:
            t0 = time.perf_counter()
            word[0] = i
            while word[1] != i:
                pass
            times.append(time.perf_counter() - t0)
        else:
            while word[0] != i:
                pass
            word[1] = i
    if ping:
        out.put(times)
    del word
    shm.close()


def _gap(seconds: float) -> None:
    """Spin between trips, as a sender does between batches (its peer's threads idle meanwhile)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _zmq_side(address: str, ping: bool, n: int, spin: bool, out, busy: str = "", gap: float = 0.0) -> None:
    import zmq

    look = None
    if "cuda" in busy:  # a CUDA context in the process, as both of the demo's have
        import torch

        torch.ones(1, device="cuda").sum().item()
    if "nixl" in busy:  # a NIXL agent whose progress thread runs, looked at in the loop as the demo does
        from kvplan.transport.engines.nixl import nixl_api

        nixl_agent, nixl_agent_config = nixl_api()
        agent = nixl_agent(f"hops-{os.getpid()}", nixl_agent_config(True, backends=["UCX"]))
        look = agent.get_new_notifs
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 1000)
    (sock.connect if ping else sock.bind)(address)

    def recv() -> None:
        if spin:
            while not sock.poll(0):
                if look is not None:
                    look()
                os.sched_yield()
        elif not sock.poll(10_000):
            raise TimeoutError("no message within 10 s")
        sock.recv_multipart()

    times = []
    if ping:
        time.sleep(0.2)
    for _ in range(n):
        if ping:
            t0 = time.perf_counter()
            sock.send_multipart([b"wave-done", b'{"wave": 1}'])
            recv()
            times.append(time.perf_counter() - t0)
            _gap(gap)
        else:
            recv()
            sock.send_multipart([b"wave-done", b'{"wave": 1}'])
    if ping:
        out.put(times)
    sock.close()


def _nixl_side(name: str, ping: bool, n: int, box, out, gap: float = 0.0) -> None:
    from kvplan.transport.engines.nixl import nixl_api

    nixl_agent, nixl_agent_config = nixl_api()
    agent = nixl_agent(name, nixl_agent_config(True, backends=["UCX"]))
    box.put((name, agent.get_agent_metadata()))
    other = None
    while other is None:
        peer, meta = box.get(timeout=30)
        if peer == name:
            box.put((peer, meta))
            time.sleep(0.01)
            continue
        other = agent.add_remote_agent(meta)
    other = other.decode() if isinstance(other, bytes) else other
    time.sleep(0.5)

    def recv() -> None:
        deadline = time.monotonic() + 10
        while not agent.get_new_notifs():
            if time.monotonic() > deadline:
                raise TimeoutError("no notification within 10 s")

    times = []
    if ping:
        for _ in range(50):  # the first notification makes the connection
            try:
                agent.send_notif(other, b"hello")
                break
            except Exception:  # noqa: BLE001 - the peer's metadata may still be loading
                time.sleep(0.05)
        recv()
    else:
        recv()
        agent.send_notif(other, b"hello")
    for _ in range(n):
        if ping:
            t0 = time.perf_counter()
            agent.send_notif(other, b"w1")
            recv()
            times.append(time.perf_counter() - t0)
            _gap(gap)
        else:
            recv()
            agent.send_notif(other, b"w1")
    if ping:
        out.put(times)
    time.sleep(0.5)


def _pair(target, args_ping, args_pong, out) -> list[float]:
    ctx = mp.get_context("spawn")
    pong = ctx.Process(target=target, args=args_pong)
    ping = ctx.Process(target=target, args=args_ping)
    pong.start()
    ping.start()
    try:
        return out.get(timeout=120)
    finally:
        for p in (ping, pong):
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def _report(label: str, times: list[float]) -> None:
    trips = np.array(times[WARM:]) * 1e6 / 2
    print(f"{label:44s} one way: median {np.median(trips):7.1f} us, p90 {np.percentile(trips, 90):7.1f} us", flush=True)


def main() -> None:
    from multiprocessing import shared_memory

    ctx = mp.get_context("spawn")
    n = TRIPS + WARM
    shm = shared_memory.SharedMemory(create=True, size=16)
    np.ndarray((2,), np.int64, buffer=shm.buf)[:] = 0
    out = ctx.Queue()
    _report("shared-memory word, both spinning", _pair(_spin_word, (shm.name, True, n, out), (shm.name, False, n, out), out))
    shm.close()
    shm.unlink()
    for address, spin, label in (("tcp://127.0.0.1:29471", True, "ZeroMQ PAIR, TCP loopback, spinning"),
                                 ("tcp://127.0.0.1:29472", False, "ZeroMQ PAIR, TCP loopback, blocking poll"),
                                 (f"ipc:///tmp/kvplan-hops-{os.getpid()}", True, "ZeroMQ PAIR, Unix socket, spinning")):
        _report(label, _pair(_zmq_side, (address, True, n, spin, out), (address, False, n, spin, out), out))
    import torch

    for busy in ("cuda", "nixl", "cuda+nixl") if torch.cuda.is_available() else ("nixl",):
        address = f"tcp://127.0.0.1:{29480 + len(busy)}"
        _report(f"ZeroMQ TCP, spinning, with {busy}",
                _pair(_zmq_side, (address, True, n, True, out, busy), (address, False, n, True, out, busy), out))
    # trips 2 ms apart (a batch's few control messages, then nothing): ZeroMQ's I/O threads sleep between them
    address = "tcp://127.0.0.1:29479"
    m = WARM + TRIPS // 4
    _report("ZeroMQ TCP, spinning, 2 ms apart",
            _pair(_zmq_side, (address, True, m, True, out, "", 0.002), (address, False, m, True, out), out))
    try:
        from kvplan.transport.engines.nixl import nixl_api

        nixl_api()
    except Exception as err:  # noqa: BLE001 - NIXL is optional here
        print(f"NIXL notifications: skipped ({type(err).__name__}: {err})")
        return
    for gap in (0.0, 0.002):
        box = ctx.Queue()
        _report(f"NIXL send_notif (UCX, progress thread), spinning, {gap * 1e3:.0f} ms apart",
                _pair(_nixl_side, (f"hops-a{gap}", True, n // (1 + 4 * (gap > 0)), box, out, gap),
                      (f"hops-b{gap}", False, n // (1 + 4 * (gap > 0)), box, out), out))


if __name__ == "__main__":
    main()
