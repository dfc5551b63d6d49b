"""The server tests' shared `kvpilot serve` subprocess (support.servers) on loopback with the embedded model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support.servers import ADMIN_TOKEN, Server, start_server, stop_server, wait_idle


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("serve"), token=ADMIN_TOKEN)
    yield srv
    stop_server(srv)
    assert "Traceback" not in srv.log(), srv.log()[-4000:]


@pytest.fixture
def quiet(server: Server) -> Server:
    """The shared server, checked idle: no request left running by an earlier test."""
    wait_idle(server)
    return server


@pytest.fixture(scope="module")
def client(server: Server):  # noqa: ANN201
    """The official openai client on the shared server."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
