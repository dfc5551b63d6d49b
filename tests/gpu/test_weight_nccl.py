"""The nccl weight transport on CUDA: the gloo test's trainer (`tests/weights/test_weight_gloo.py`, its CPU
twin) on CUDA tensors. The test is the trainer, rank 0 on cuda:0; the daemon serves on cuda:1 (NCCL refuses
two ranks of one group on one GPU, so this needs two). The weights that arrive are checked bit for bit:
the digest after the broadcast equals the one the same daemon reports after staging the same checkpoint
from disk, and replies carry the new version."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchkit import changed_checkpoint as changed_checkpoint_of
from support.servers import Server
from support.weights import admin, complete, prompt_ids, trainer_broadcast, update, weights_daemon

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2,
    reason="the nccl transport needs 2 CUDA devices: NCCL refuses two ranks of one group on one GPU",
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from kvpilot.default_model import ensure_default_model

    original = ensure_default_model()
    return original, changed_checkpoint_of(original, tmp_path_factory.mktemp("changed-ckpt"))


@pytest.fixture(scope="module")
def nccl_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = ("--device", "cuda:1", "--dtype", "float32", "--weight-transfer-config", '{"backend": "nccl"}')
    with weights_daemon(tmp_path_factory.mktemp("weights-nccl"), *flags) as srv:
        yield srv


def test_a_trainer_broadcasts_new_weights_over_nccl(
    nccl_daemon: Server, checkpoints: tuple[Path, Path]
) -> None:
    original, changed = checkpoints
    srv = nccl_daemon
    before = admin(srv, "GET", "/weight_info")["digest"]
    staged = trainer_broadcast(srv, changed, "nccl-1", backend="nccl")
    assert staged["staged_digest"] != before
    assert complete(srv, prompt_ids(original), 4)["system_fingerprint"] == "nccl-1"
    from_disk = update(srv, changed, "disk-1")  # the same checkpoint, read from disk
    assert from_disk["digest"] == staged["staged_digest"]
