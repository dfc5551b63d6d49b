"""507: the staging copy of an update does not fit the host memory it may take. The real daemon runs with
`--weight-staging-memory-bytes` at 8 MB: a whole checkpoint (its embedding alone is 113 MB) is refused
with 507 naming the tensor, nothing changes (the old weights still answer, no stage is left open) and
the next update that fits (one MLP projection, 3.5 MB) goes through."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.servers import Server
from support.weights import admin, complete, greedy, prompt_ids, refused_at_start, tokenizer, weights_daemon

TOKENS = 6
CAP = 8_000_000
SMALL = "model.layers.3.mlp.down_proj.weight"  # 576 x 1536 float32: 3.5 MB


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = ("--weight-version", "v1", "--weight-staging-memory-bytes", str(CAP))
    with weights_daemon(tmp_path_factory.mktemp("weights-507"), *flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def one_tensor_checkpoint(tmp_path_factory: pytest.TempPathFactory, changed_checkpoint: Path) -> Path:
    """A partial checkpoint: one changed tensor of the changed checkpoint."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("one-tensor-ckpt")
    with safe_open(str(changed_checkpoint / "model.safetensors"), framework="pt") as st:
        save_file({SMALL: st.get_tensor(SMALL)}, str(out / "model.safetensors"))
    return out


def test_a_stage_beyond_the_cap_is_507_and_changes_nothing(
    capped: Server, original_checkpoint: Path, changed_checkpoint: Path, one_tensor_checkpoint: Path
) -> None:
    srv = capped
    ids = prompt_ids(original_checkpoint)
    want = tokenizer(original_checkpoint).decode(list(greedy(original_checkpoint, tuple(ids), TOKENS)))
    before = admin(srv, "GET", "/weight_info")

    admin(srv, "POST", "/start_weight_update")
    body = {"update_info": {"model_path": str(changed_checkpoint)}}
    refused = admin(srv, "POST", "/update_weights", body, expect=507)
    assert refused["error"]["code"] == "no_staging_memory", refused
    assert refused["tensor"] and "--weight-staging-memory-bytes" in refused["error"]["message"], refused

    info = admin(srv, "GET", "/weight_info")
    assert info["ranks"][0]["staging"] is False  # the stage is dropped, its memory freed
    assert info["weight_version"] == "v1" and info["digest"] == before["digest"]
    reply = complete(srv, ids, TOKENS)
    assert reply["choices"][0]["text"] == want and reply["system_fingerprint"] == "v1"
    admin(srv, "POST", "/finish_weight_update", {"weight_version": "v2"}, expect=409)  # nothing to swap
    assert srv.metrics()['kvpilot_weight_updates_total{result="failed"}'] >= 1

    # The next start works, and an update within the cap is taken.
    admin(srv, "POST", "/start_weight_update")
    staged = admin(
        srv, "POST", "/update_weights", {"update_info": {"model_path": str(one_tensor_checkpoint)}}
    )
    assert staged["staged_digest"] != before["digest"]
    done = admin(srv, "POST", "/finish_weight_update", {"weight_version": "v2"})
    assert done["weight_version"] == "v2" and done["digest"] == staged["staged_digest"]
    assert complete(srv, ids, TOKENS)["system_fingerprint"] == "v2"
    assert srv.request("GET", "/health").json()["status"] == "ok"


def test_the_cap_must_be_positive() -> None:
    assert "weight-staging-memory-bytes" in refused_at_start("--weight-staging-memory-bytes", "0")
