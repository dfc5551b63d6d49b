"""A rank that fails in the middle of a weight update, with `--data-parallel-size 2`; the failure is real:
rank 1's process (an engine-core process of its own, `daemon/engine/parallel/dp_rank.py`) is stopped and killed.

- At the swap: rank 0 swapped and rank 1 died before it did. The finish answers 500 naming rank 1,
  `/health` turns 503 (readiness takes the pod out) and no request is served any more, on either rank,
  so nothing is ever computed by mixed weights.
- At the stage: rank 1 died; the update answers 500 naming it, rank 0's stage is dropped and a finish
  swaps nothing: rank 0 still holds the old weights.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.procs import wait_for
from support.servers import Server
from support.weights import admin, prompt_ids, weights_daemon

LONG_PROMPT = 2000  # tokens: a prefill step (2048 tokens) of rank 1 takes seconds on its CPU share


@pytest.fixture
def dp_daemon(tmp_path: Path) -> Iterator[Server]:
    """A daemon of its own per test: each test kills one of its ranks."""
    # One torch thread per rank, whatever the machine: a 2048-token prefill step then takes seconds.
    flags = (
        "--data-parallel-size",
        "2",
        "--weight-version",
        "v1",
        "--max-model-len",
        "2048",
        "--cpu-threads",
        "1",
    )
    with weights_daemon(tmp_path, *flags) as srv:
        yield srv


def _rank_pid(srv: Server, rank: int) -> int:
    m = re.search(rf"rank {rank} ready \(pid (\d+)", srv.log())
    assert m, srv.log()[-3000:]
    return int(m.group(1))


def _swapped(srv: Server, rank: int, version: str) -> bool:
    return re.search(rf"rank{rank} \S+: weights {version} swapped in", srv.log()) is not None


def _keep_busy(srv: Server, seed: int, stop: threading.Event, done: list) -> None:
    """Long prompts of random tokens (never cached) on rank 1, one after another: with a few of these
    side by side rank 1 is always inside a long prefill step."""
    import random

    rng = random.Random(seed)
    while not stop.is_set():
        body = {"prompt": [rng.randrange(100, 5000) for _ in range(LONG_PROMPT)], "max_tokens": 1}
        try:
            srv.request("POST", "/v1/completions", body, headers={"X-data-parallel-rank": "1"}, timeout=300)
        except OSError:
            return
        done.append(seed)


def _stop_rank_after_rank0_swapped(srv: Server, pid: int, version: str, seen: dict) -> None:
    """Once rank 0 has swapped, freeze rank 1 (SIGSTOP) and note whether it had swapped too: if not, kill
    it; if it had (the finish reached it between two steps), let it go on."""
    wait_for(lambda: _swapped(srv, 0, version), 300, "rank 0's swap", interval=0.02)
    os.kill(pid, signal.SIGSTOP)
    time.sleep(0.5)  # a log line rank 1 was writing when it stopped is in the file by now
    seen["rank1_swapped"] = _swapped(srv, 1, version)
    os.kill(pid, signal.SIGCONT if seen["rank1_swapped"] else signal.SIGKILL)


def test_a_rank_dying_at_the_swap_makes_the_daemon_unhealthy(
    dp_daemon: Server, original_checkpoint: Path, changed_checkpoint: Path
) -> None:
    srv = dp_daemon
    ids = prompt_ids(original_checkpoint)
    # Rank 1 busy with long prefills: the finish reaches it inside one, so it swaps seconds after rank 0
    # (a finish without a pause is allowed: running requests are recomputed with the new weights).
    stop, done = threading.Event(), []
    for seed in range(3):
        threading.Thread(target=_keep_busy, args=(srv, seed, stop, done), daemon=True).start()
    wait_for(lambda: done, 600, "rank 1 busy with long prompts")
    # The finish can still reach rank 1 between two of its steps (it answers the finish's weight_info
    # check there, and may find the finish before its next step): then both ranks swap, and the update
    # is tried again with the other checkpoint, until rank 1 is caught before its swap.
    checkpoints = [changed_checkpoint, original_checkpoint] * 2 + [changed_checkpoint]
    try:
        for attempt, checkpoint in enumerate(checkpoints):
            version = f"v{attempt + 2}"
            admin(srv, "POST", "/start_weight_update")
            admin(srv, "POST", "/update_weights", {"update_info": {"model_path": str(checkpoint)}})
            seen: dict = {}
            killer = threading.Thread(
                target=_stop_rank_after_rank0_swapped,
                args=(srv, _rank_pid(srv, 1), version, seen),
                daemon=True,
            )
            killer.start()
            r = srv.request(
                "POST", "/finish_weight_update", {"weight_version": version}, headers=srv.admin(), timeout=300
            )
            killer.join(300)
            if not seen["rank1_swapped"]:
                break
            assert r.status == 200, r.body
    finally:
        stop.set()
    assert seen == {"rank1_swapped": False}, ("rank 1 swapped before it was stopped, every time", seen)

    assert r.status == 500, r.body
    body = r.json()
    assert body["error"]["code"] == "weight_update_failed"
    assert "rank 1" in body["error"]["message"] and "mixed weights" in body["error"]["message"], body
    by_rank = {x["rank"]: x for x in body["ranks"]}
    assert by_rank[0]["weight_version"] == version and "error" not in by_rank[0], body
    assert "error" in by_rank[1], body

    health = srv.request("GET", "/health")
    assert health.status == 503 and health.json()["status"] == "unhealthy", health.body
    assert "rank 1" in health.json()["reason"] and "mixed weights" in health.json()["reason"], health.body
    for headers in ({}, {"X-data-parallel-rank": "0"}):  # rank 0 alone would answer with v2's weights
        reply = srv.request(
            "POST", "/v1/completions", {"prompt": ids, "max_tokens": 2, "temperature": 0}, headers=headers
        )
        assert reply.status == 503, (headers, reply.status, reply.body)
    assert srv.metrics()['kvpilot_weight_updates_total{result="failed"}'] >= 1


def test_a_rank_dying_at_the_stage_leaves_the_old_weights(
    dp_daemon: Server, changed_checkpoint: Path
) -> None:
    srv = dp_daemon
    admin(srv, "POST", "/start_weight_update")
    os.kill(_rank_pid(srv, 1), signal.SIGKILL)
    wait_for(lambda: srv.request("GET", "/health").status == 503, 60, "rank 1's death seen")

    body = {"update_info": {"model_path": str(changed_checkpoint)}}
    refused = admin(srv, "POST", "/update_weights", body, expect=500)
    assert "rank 1" in refused["error"]["message"], refused
    finish = admin(srv, "POST", "/finish_weight_update", {"weight_version": "v2"}, expect=500)
    assert "rank 1" in finish["error"]["message"], finish
    # Rank 0 answers beside the dead rank: its stage was dropped with the refused update, nothing swapped.
    rank0 = next(x for x in admin(srv, "GET", "/weight_info", expect=500)["ranks"] if x["rank"] == 0)
    assert rank0["staging"] is False and rank0["weight_version"] == "v1", rank0
    assert not _swapped(srv, 0, "v2")
