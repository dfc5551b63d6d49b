"""The gloo transport: a trainer (this test, as torch.distributed rank 0 on loopback) hosts the group,
the daemon joins it through `/init_weight_transfer_engine` with vLLM's NCCL-style `init_info`, and the
trainer broadcasts the changed weights while `/update_weights` announces them (`names`, `dtype_names`,
`shapes`). Afterwards the daemon answers as transformers does on the changed checkpoint. This is the CPU
twin of the nccl transport's test (`tests/gpu/test_weight_nccl.py`, the same trainer on CUDA tensors);
here, nccl is refused at start (no CUDA)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.servers import Server
from support.weights import (
    admin,
    complete,
    greedy,
    prompt_ids,
    refused_at_start,
    tokenizer,
    trainer_broadcast,
    weights_daemon,
)

TOKENS = 6


@pytest.fixture(scope="module")
def gloo_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with weights_daemon(
        tmp_path_factory.mktemp("weights-gloo"), "--weight-transfer-config", '{"backend": "gloo"}'
    ) as srv:
        yield srv


def test_a_trainer_broadcasts_new_weights(
    gloo_daemon: Server, original_checkpoint: Path, changed_checkpoint: Path
) -> None:
    srv = gloo_daemon
    health = srv.request("GET", "/health").json()  # loaded without --weight-version, never updated
    assert health["weight_version"] == "initial" and health["digest"] is None, health
    staged = trainer_broadcast(srv, changed_checkpoint, "gloo-1")

    ids = prompt_ids(original_checkpoint)
    reply = complete(srv, ids, TOKENS)
    want = tokenizer(changed_checkpoint).decode(list(greedy(changed_checkpoint, tuple(ids), TOKENS)))
    assert reply["choices"][0]["text"] == want and reply["system_fingerprint"] == "gloo-1"
    assert admin(srv, "GET", "/weight_info")["digest"] == staged["staged_digest"]
    # An update announced without a group is out of order.
    admin(srv, "POST", "/start_weight_update")
    update_info = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[576]]}
    admin(srv, "POST", "/update_weights", {"update_info": update_info}, expect=409)
    admin(srv, "POST", "/abort_weight_update")


def test_nccl_without_cuda_is_refused_at_start() -> None:
    stderr = refused_at_start("--device", "cpu", "--weight-transfer-config", '{"backend": "nccl"}')
    assert '"nccl" needs a CUDA device' in stderr and "gloo" in stderr, stderr[-2000:]
