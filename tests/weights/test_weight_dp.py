"""With `--data-parallel-size 2` a weight update is one act over both ranks: both swap (each then answers
with the new weights, as transformers does on the new checkpoint) or, when the update is refused,
neither does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.servers import Server
from support.weights import admin, greedy, prompt_ids, stage_incompatible, tokenizer, update, weights_daemon

TOKENS = 6


@pytest.fixture(scope="module")
def dp_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = ("--data-parallel-size", "2", "--weight-version", "v1")
    with weights_daemon(tmp_path_factory.mktemp("weights-dp"), *flags) as srv:
        yield srv


def _on_rank(srv: Server, ids: list[int], rank: int) -> dict:
    body = {"prompt": ids, "max_tokens": TOKENS, "temperature": 0}
    r = srv.request("POST", "/v1/completions", body, headers={"X-data-parallel-rank": str(rank)})
    assert r.status == 200, r.body
    return r.json()


def test_both_ranks_swap_or_neither(
    dp_daemon: Server, original_checkpoint: Path, changed_checkpoint: Path, incompatible_checkpoint: Path
) -> None:
    srv = dp_daemon
    ids = prompt_ids(original_checkpoint)
    assert admin(srv, "GET", "/get_world_size") == {"world_size": 2}

    refused = stage_incompatible(srv, incompatible_checkpoint)
    assert [r["rank"] for r in refused["ranks"]] == [0, 1] and all(r["tensor"] for r in refused["ranks"])
    info = admin(srv, "GET", "/weight_info")
    assert [r["weight_version"] for r in info["ranks"]] == ["v1", "v1"]  # neither changed

    done = update(srv, changed_checkpoint, "v2")
    assert [r["weight_version"] for r in done["ranks"]] == ["v2", "v2"]
    info = admin(srv, "GET", "/weight_info")
    assert info["weight_version"] == "v2"
    assert {r["digest"] for r in info["ranks"]} == {done["digest"]}
    want = tokenizer(changed_checkpoint).decode(list(greedy(changed_checkpoint, tuple(ids), TOKENS)))
    for rank in (0, 1):
        reply = _on_rank(srv, ids, rank)
        assert reply["choices"][0]["text"] == want, (rank, reply)
        assert reply["system_fingerprint"] == "v2"
    assert srv.request("GET", "/health").json()["weight_version"] == "v2"
