"""Tensor parallel: one Llama-family model sharded over N processes with torch.distributed (gloo on the
CPU, NCCL on CUDA), driven by one scheduler.

Shard r holds attention heads [r*H/N, (r+1)*H/N) and their KV heads (so the KV cache is split by head
too), and the matching slice of the MLP's intermediate features: q/k/v and gate/up are column-parallel
(each shard computes its own output features), o_proj and down_proj row-parallel (each shard multiplies
its input slice and an all-reduce sums them). Embeddings, norms and the LM head stay whole on every shard.

Rank 0 is the `LLMEngine` process: it owns the scheduler, the sampler and the API; the other shards are
worker processes it spawns, each running `shard_main`: they receive every step's `StepPlan` (plain lists)
from rank 0 by broadcast, run the same forward pass on their shard and discard the logits.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.models.llama import LlamaArgs, LlamaDecoderLayer, LlamaForCausalLM

log = logging.getLogger(__name__)

# A step waits on every shard; a shard silent this long is gone (loading a model counts, hence large).
GROUP_TIMEOUT = datetime.timedelta(minutes=30)


def check_divisible(args: LlamaArgs, size: int) -> None:
    bad = [
        f"{name} ({value})"
        for name, value in (
            ("attention heads", args.num_heads),
            ("KV heads", args.num_kv_heads),
            ("MLP intermediate size", args.intermediate_size),
        )
        if value % size
    ]
    if bad:
        raise ValueError(
            f"--tensor-parallel-size {size} must divide the model's {', '.join(bad)}: shards split them evenly"
        )


class RowParallelLinear(nn.Module):
    """x[:, shard] @ W[:, shard].T on each shard, summed over the shards."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out)
        return out


def _column(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    w = linear.weight.data.index_select(0, rows)
    out = nn.Linear(w.shape[1], w.shape[0], bias=linear.bias is not None, device=w.device, dtype=w.dtype)
    out.weight.data.copy_(w)
    if linear.bias is not None:
        out.bias.data.copy_(linear.bias.data.index_select(0, rows))
    return out.requires_grad_(False)


def shard_model(model: LlamaForCausalLM, rank: int, size: int) -> None:
    """Cut a loaded model down to shard `rank` of `size`, in place."""
    a = model.args
    check_divisible(a, size)
    d = a.head_dim
    h, kvh, inter = a.num_heads // size, a.num_kv_heads // size, a.intermediate_size // size
    q_size, kv_size = a.num_heads * d, a.num_kv_heads * d
    dev = model.embed_tokens.weight.device

    def span(start: int, n: int) -> torch.Tensor:
        return torch.arange(start + rank * n, start + (rank + 1) * n, device=dev)

    qkv_rows = torch.cat([span(0, h * d), span(q_size, kvh * d), span(q_size + kv_size, kvh * d)])
    gate_up_rows = torch.cat([span(0, inter), span(a.intermediate_size, inter)])
    for layer in cast(Iterable[LlamaDecoderLayer], model.layers):  # a ModuleList of them
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _column(attn.qkv_proj, qkv_rows)
        attn.o_proj = RowParallelLinear(attn.o_proj.weight.data[:, rank * h * d : (rank + 1) * h * d])
        attn.num_heads, attn.num_kv_heads, attn.q_size, attn.kv_size = h, kvh, h * d, kvh * d
        mlp.gate_up_proj = _column(mlp.gate_up_proj, gate_up_rows)
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight.data[:, rank * inter : (rank + 1) * inter])
    model.args = dataclasses.replace(a, num_heads=h, num_kv_heads=kvh, intermediate_size=inter)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class TensorParallel:
    """Rank 0's side: spawns the other shards, joins the group, shards its own model."""

    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, device: torch.device) -> None:
        size = config.tensor_parallel_size
        check_divisible(model.args, size)
        # The group's store, bound first on a port the kernel picks and held: a port found free and bound
        # later could be taken meanwhile by any connection's own end (the ephemeral range it came from).
        store = dist.TCPStore(
            "127.0.0.1", 0, size, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False
        )
        port = store.port
        ctx = multiprocessing.get_context("spawn")
        self.workers = [
            ctx.Process(
                target=shard_main,
                args=(r, config, port, os.getpid(), logging.getLogger().getEffectiveLevel()),
                name=f"kvpilot-tp{r}",
                daemon=True,  # ended with this process (multiprocessing's exit handler)
            )
            for r in range(1, size)
        ]
        for w in self.workers:
            w.start()
        dist.init_process_group(_backend(device), store=store, rank=0, world_size=size, timeout=GROUP_TIMEOUT)
        shard_model(model, 0, size)
        self.size = size

    def share_num_blocks(self, num_blocks: int) -> None:
        """Every shard holds the same block ids (its own heads of each block)."""
        dist.broadcast_object_list([num_blocks], src=0)

    def send_step(self, plan: object) -> None:
        dist.broadcast_object_list([plan], src=0)


def shard_main(rank: int, config: EngineConfig, port: int, parent_pid: int, log_level: int) -> None:
    """A worker shard: load, cut to its shard, then run every step rank 0 broadcasts."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the shards stop
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    from kvpilot.daemon.engine.cpu_budget import engine_threads
    from kvpilot.daemon.engine.loader import load
    from kvpilot.daemon.engine.model_runner import ModelRunner
    from kvpilot.kernels import select_ops

    device = config.torch_device()
    if device.type == "cuda":
        device = torch.device("cuda", (device.index or 0) + rank)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(engine_threads(config.cpu_threads))
    dtype = config.torch_dtype(device)
    # rank 0's store, joined as rank 0 joined it (a store given, not an init_method, which would prefix its keys)
    size = config.tensor_parallel_size
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=GROUP_TIMEOUT)
    dist.init_process_group(_backend(device), store=store, rank=rank, world_size=size, timeout=GROUP_TIMEOUT)
    model = load(config.model, select_ops(device, config.kernel_backend), dtype, device).model
    shard_model(model, rank, size)
    # What rank 0 broadcasts, one object at a time: the pool's block count, then each step's plan.
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    runner = ModelRunner(model, box[0], config.block_size, dtype, device)
    log.info("tensor-parallel shard %d ready (pid %d)", rank, os.getpid())
    while True:
        dist.broadcast_object_list(box, src=0)
        runner.run(box[0])


def _exit_with_parent(parent_pid: int) -> None:
    """A shard whose rank 0 died (even by SIGKILL) exits instead of waiting on the group."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)
