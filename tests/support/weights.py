"""Weight update test helpers: transformers' greedy reference, completions by token ids, and a trainer's
update through the daemon's vLLM routes."""

from __future__ import annotations

import functools
from pathlib import Path

from support.servers import Server

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
