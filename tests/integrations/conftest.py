"""Fixtures of the SGLang integration tests."""

import socket

import pytest

from tests.integrations.sglang_sides import bootstrap_server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server():
    """SGLang's bootstrap server on a free loopback port, once it answers its health check; the port."""
    srv = bootstrap_server(_free_port())
    yield srv.port
    srv.close()
