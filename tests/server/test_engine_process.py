"""`kvpilot serve --engine-process`: the engine runs in a process of its own (a data-parallel rank of one,
daemon/engine/parallel/dp_rank.py), not in a thread of the server's. It answers the shared in-thread
daemon's greedy chats, hits and resets its cache, and its log names the engine's process apart from the
server's, on all CPUs but one (the server's)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from kvpilot.daemon.engine.cpu_budget import available_cpus
from support.servers import ADMIN_TOKEN, Server, greedy_chat, start_server, stop_server

CHATS = ["What does a scheduler do?", "Name two kinds of tea."]


@pytest.fixture(scope="module")
def own_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("engine-process"), "--engine-process", token=ADMIN_TOKEN)
    yield srv
    stop_server(srv)
    assert "Traceback" not in srv.log(), srv.log()[-4000:]


def test_an_engine_in_its_own_process_answers_as_the_threaded_one(
    own_process: Server, server: Server
) -> None:
    log = own_process.log()
    m = re.search(r"rank 0 ready \(pid (\d+), cpus \[([\d, ]+)\]\)", log)
    assert m and int(m.group(1)) != own_process.proc.pid, log[-3000:]
    # all CPUs but one, as the engine thread's default: the other is the server's
    threads = max(1, available_cpus() - 1)
    assert len(m.group(2).split(",")) == threads and f"{threads} torch threads" in log, log[-3000:]
    eager = [greedy_chat(server, c)[0] for c in CHATS]
    assert [greedy_chat(own_process, c)[0] for c in CHATS] == eager
    assert greedy_chat(own_process, CHATS[0])[1] > 0  # the prompt again: served from the cache
    r = own_process.request("POST", "/reset_prefix_cache", headers=own_process.admin())
    assert r.status == 200, r.body
    assert greedy_chat(own_process, CHATS[0]) == (eager[0], 0)
    assert own_process.request("GET", "/health").status == 200
