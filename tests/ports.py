"""Free loopback ports for tests that start listeners (processes of their own, or servers in this one)."""

import random
import socket


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768 and up by default): a port found free in
    that range can be taken by an outgoing connection before the test's listener binds it."""
    for port in random.Random().sample(range(20000, 32768), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and 32767")


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports (:func:`free_port`)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def free_span(count: int) -> int:
    """A port ``p`` with ``p .. p + count - 1`` all free (each TP rank of one engine listens at its base port
    plus its rank)."""
    for _ in range(200):
        base = free_port()
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} free ports in a row between 20000 and 32767")
