"""Weight update test helpers: transformers' greedy reference, completions by token ids, and a trainer's
update through the daemon's vLLM routes."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

from support.servers import ADMIN_TOKEN, Server, start_server, stop_server

# Two full KV blocks and a bit, so a repeat hits the prefix cache.
PROMPT = "The weather report for the coast says that tomorrow the wind will turn to the north and bring"


@functools.lru_cache(maxsize=16)
def greedy(checkpoint: Path, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    """transformers' greedy continuation of `prompt` on `checkpoint`: the reference."""
    import torch

    model = _hf_model(checkpoint)
    torch.set_num_threads(1)  # beside the daemon on a small machine, more threads only contend
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=max_tokens, do_sample=False)
    return tuple(out[0, len(prompt) :].tolist())


@functools.lru_cache(maxsize=2)
def _hf_model(checkpoint: Path):  # noqa: ANN202
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=1)
def tokenizer(checkpoint: Path):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def prompt_ids(checkpoint: Path, text: str = PROMPT) -> list[int]:
    return tokenizer(checkpoint)(text)["input_ids"]


def complete(server: Server, prompt: list[int], max_tokens: int, **extra: object) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = server.request("POST", "/v1/completions", body)
    assert r.status == 200, r.body
    return r.json()


def admin(server: Server, method: str, path: str, body: dict | None = None, expect: int = 200) -> dict:
    r = server.request(method, path, body, headers=server.admin(), timeout=300)
    assert r.status == expect, (path, r.status, r.body)
    return r.json()


def update(server: Server, checkpoint: Path, version: str, mode: str = "abort") -> dict:
    """A trainer's loop, as vLLM's HTTPVLLMWeightSyncClient drives it: pause, start, update, finish,
    resume. Returns finish's reply."""
    admin(server, "POST", f"/pause?mode={mode}")
    admin(server, "POST", "/init_weight_transfer_engine", {"init_info": {}})
    admin(server, "POST", "/start_weight_update")
    staged = admin(server, "POST", "/update_weights", {"update_info": {"model_path": str(checkpoint)}})
    done = admin(server, "POST", "/finish_weight_update", {"weight_version": version})
    assert done["digest"] == staged["staged_digest"], (done, staged)
    admin(server, "POST", "/resume")
    return done


def stage_incompatible(server: Server, checkpoint: Path) -> dict:
    """Start an update and offer it `checkpoint`, which the daemon must refuse (400)."""
    admin(server, "POST", "/start_weight_update")
    return admin(
        server, "POST", "/update_weights", {"update_info": {"model_path": str(checkpoint)}}, expect=400
    )


def trainer_broadcast(server: Server, checkpoint: Path, version: str, backend: str = "gloo") -> dict:
    """A trainer's side of the torch.distributed transports (vLLM's NCCL bodies), as test rank 0 of a
    group of 2 on loopback: host the store, have the daemon join (`/init_weight_transfer_engine`),
    announce `checkpoint`'s tensors (`/update_weights`) while broadcasting them (from cuda:0 for nccl),
    finish as `version` and leave the group. Returns `/update_weights`' reply."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist
    from safetensors.torch import load_file

    from support.procs import free_port

    def in_thread(*args: object) -> tuple[threading.Thread, list]:
        out: list = []
        t = threading.Thread(target=lambda: out.append(admin(server, *args)), daemon=True)
        t.start()
        return t, out

    port = free_port()
    timeout = timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False, timeout=timeout)
    init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    joined, reply = in_thread("POST", "/init_weight_transfer_engine", {"init_info": init_info})
    group_class = dist.ProcessGroupNCCL if backend == "nccl" else dist.ProcessGroupGloo
    group = group_class(dist.PrefixStore("kvpilot-weights", store), 0, 2, timeout)
    joined.join(120)
    assert reply and reply[0]["backend"] == backend, reply

    device = "cuda:0" if backend == "nccl" else "cpu"
    tensors = {
        n: t.to(device).contiguous() for n, t in load_file(str(checkpoint / "model.safetensors")).items()
    }
    names = sorted(tensors)
    update_info = {
        "names": names,
        "dtype_names": [str(tensors[n].dtype).removeprefix("torch.") for n in names],
        "shapes": [list(tensors[n].shape) for n in names],
    }
    admin(server, "POST", "/start_weight_update")
    sent, staged = in_thread("POST", "/update_weights", {"update_info": update_info})
    for n in names:
        group.broadcast(tensors[n], 0).wait()
    sent.join(300)
    assert staged and staged[0]["staged_digest"].startswith("sha256:"), staged
    admin(server, "POST", "/finish_weight_update", {"weight_version": version})
    admin(server, "POST", "/shutdown_weight_transfer_engine")
    if backend == "nccl":
        group.shutdown()  # its communicator's GPU memory and threads
    return staged[0]


@contextlib.contextmanager
def weights_daemon(tmp: Path, *flags: str) -> Iterator[Server]:
    """A daemon with the admin token and `flags`, stopped afterwards; its log must hold no traceback."""
    srv = start_server(tmp, *flags, token=ADMIN_TOKEN)
    yield srv
    stop_server(srv)
    assert "Traceback" not in srv.log(), srv.log()[-4000:]


def refused_at_start(*flags: str) -> str:
    """`kvpilot serve FLAGS` must refuse to start (exit 2, before loading anything); returns its stderr."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "kvpilot", "serve", *flags], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    return r.stderr
