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
