"""Where each data-parallel rank runs: on CUDA its own device, on the CPU its share of the CPUs this process
may use (pinned, torch threads = the share; a lone rank, `--engine-process`, all of them but one); and
each rank's KV events on ports of its own."""

from __future__ import annotations

import dataclasses
import os

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.cpu_budget import available_cpus
from kvpilot.daemon.engine.kv.publisher import rank_endpoint


def cpu_shares(num_ranks: int, cpus: list[int]) -> list[list[int]]:
    """Split the CPUs into contiguous shares, one per rank; with fewer CPUs than ranks, ranks share."""
    if len(cpus) < num_ranks:
        return [[cpus[r % len(cpus)]] for r in range(num_ranks)]
    base, extra = divmod(len(cpus), num_ranks)
    shares, start = [], 0
    for r in range(num_ranks):
        size = base + (r < extra)
        shares.append(cpus[start : start + size])
        start += size
    return shares


def rank_configs(config: EngineConfig, size: int) -> tuple[list[EngineConfig], list[list[int] | None]]:
    """Each rank's engine config and CPU pinning: on CUDA its own device, on the CPU its share; each
    rank's KV events on their own ports (`kv/publisher.py` `rank_endpoint`)."""
    configs, shares = _placement(config, size)
    return [
        dataclasses.replace(
            c,
            data_parallel_rank=r,
            kv_events_endpoint=rank_endpoint(c.kv_events_endpoint, r),
            kv_events_replay_endpoint=rank_endpoint(c.kv_events_replay_endpoint, r),
        )
        for r, c in enumerate(configs)
    ], shares


def _placement(config: EngineConfig, size: int) -> tuple[list[EngineConfig], list[list[int] | None]]:
    device = config.torch_device()
    if device.type == "cuda":
        import torch

        if torch.cuda.device_count() < size:
            raise ValueError(
                f"--data-parallel-size {size} needs {size} CUDA devices; {torch.cuda.device_count()} visible"
            )
        return [dataclasses.replace(config, device=f"cuda:{r}") for r in range(size)], [None] * size
    cpus = sorted(os.sched_getaffinity(0))[: available_cpus()]
    if config.engine_process and size == 1 and config.cpu_threads is None and len(cpus) > 1:
        # The engine in a process of its own (--engine-process) takes all CPUs but one, as the engine
        # thread does by default (cpu_budget.engine_threads): the other is the server's, which streams
        # and tokenizes. On every CPU, its OpenMP threads waited on the one the server held: a 4-token
        # chat took 1.5-5 s on a busy 2-CPU machine, against 0.26-0.33 s with one thread.
        cpus = cpus[:-1]
    shares = cpu_shares(size, cpus)
    configs = [
        dataclasses.replace(config, device="cpu", cpu_threads=config.cpu_threads or len(share))
        for share in shares
    ]
    return configs, [*shares]  # (a copy: the list holds list[int] | None)
