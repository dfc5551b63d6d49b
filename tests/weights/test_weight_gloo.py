"""The gloo transport: a trainer (this test, as torch.distributed rank 0 on loopback) hosts the group,
the daemon joins it through `/init_weight_transfer_engine` with vLLM's NCCL-style `init_info`, and the
trainer broadcasts the changed weights while `/update_weights` announces them (`names`, `dtype_names`,
`shapes`). Afterwards the daemon answers as transformers does on the changed checkpoint."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from support.procs import free_port
from support.servers import ADMIN_TOKEN, Server, start_server, stop_server
from support.weights import admin, complete, greedy, prompt_ids, tokenizer

TOKENS = 6


@pytest.fixture(scope="module")
def gloo_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("weights-gloo"),
        "--weight-transfer-config",
        '{"backend": "gloo"}',
        token=ADMIN_TOKEN,
    )
    yield srv
    stop_server(srv)
    assert "Traceback" not in srv.log(), srv.log()[-4000:]


def _in_thread(fn, *args) -> tuple[threading.Thread, list]:  # noqa: ANN001
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    return t, out


def test_a_trainer_broadcasts_new_weights(
    gloo_daemon: Server, original_checkpoint: Path, changed_checkpoint: Path
) -> None:

    import torch.distributed as dist
    from safetensors.torch import load_file

    srv = gloo_daemon
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
    )
    init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    joined, reply = _in_thread(admin, srv, "POST", "/init_weight_transfer_engine", {"init_info": init_info})
    group = dist.ProcessGroupGloo(dist.PrefixStore("kvpilot-weights", store), 0, 2, timedelta(seconds=120))
    joined.join(120)
    assert reply and reply[0]["backend"] == "gloo", reply

    tensors = load_file(str(changed_checkpoint / "model.safetensors"))
    names = sorted(tensors)
    update_info = {
        "names": names,
        "dtype_names": [str(tensors[n].dtype).removeprefix("torch.") for n in names],
        "shapes": [list(tensors[n].shape) for n in names],
    }
    admin(srv, "POST", "/start_weight_update")
    sent, staged = _in_thread(admin, srv, "POST", "/update_weights", {"update_info": update_info})
    for n in names:
        group.broadcast(tensors[n].contiguous(), 0).wait()
    sent.join(300)
    assert staged and staged[0]["staged_digest"].startswith("sha256:"), staged
    admin(srv, "POST", "/finish_weight_update", {"weight_version": "gloo-1"})
    admin(srv, "POST", "/shutdown_weight_transfer_engine")

    ids = prompt_ids(original_checkpoint)
    reply = complete(srv, ids, TOKENS)
    want = tokenizer(changed_checkpoint).decode(list(greedy(changed_checkpoint, tuple(ids), TOKENS)))
    assert reply["choices"][0]["text"] == want and reply["system_fingerprint"] == "gloo-1"
    # An update announced without a group is out of order.
    admin(srv, "POST", "/start_weight_update")
    admin(srv, "POST", "/update_weights", {"update_info": update_info}, expect=409)
