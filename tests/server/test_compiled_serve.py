"""`kvpilot serve -O1 --engine-process`, as a user starts it: the step compiled in the engine's own process
(a data-parallel rank of one) serves the same greedy chats as the shared eager daemon, before and after a
reset, and its log says how the step runs and what compiling took. The compiled step in the server's
process is tests/engine/test_compile.py's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support.servers import ADMIN_TOKEN, Server, greedy_chat, start_server, stop_server

CHATS = ["What does a compiler do?", "Name three colours of the sea."]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("compiled"), "-O1", "--engine-process", token=ADMIN_TOKEN)
    yield srv
    stop_server(srv)
    assert "Traceback" not in srv.log(), srv.log()[-4000:]


def test_a_compiled_daemon_answers_as_the_eager_one(compiled: Server, server: Server) -> None:
    assert "engine step: torch.compile (-O1)" in compiled.log()
    eager = [greedy_chat(server, c)[0] for c in CHATS]
    assert [greedy_chat(compiled, c)[0] for c in CHATS] == eager
    assert "the step compiled in" in compiled.log()
    assert greedy_chat(compiled, CHATS[0])[1] > 0  # the prompt again: served from the cache
    r = compiled.request("POST", "/reset_prefix_cache", headers=compiled.admin())
    assert r.status == 200, r.body
    assert greedy_chat(compiled, CHATS[0]) == (eager[0], 0)
