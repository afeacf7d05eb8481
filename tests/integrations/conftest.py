"""Fixtures of the SGLang integration tests."""

import pytest

from tests.integrations.sglang_sides import bootstrap_server
from tests.ports import free_port


@pytest.fixture
def server():
    """SGLang's bootstrap server on a free loopback port, once it answers its health check; the port."""
    srv = bootstrap_server(free_port())
    yield srv.port
    srv.close()
