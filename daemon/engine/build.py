"""What an engine is made of, built once from its config: the model (loaded, and sharded when tensor
parallel), the KV pool sized to its memory, the pool's tiers and event publisher, the scheduler, the
model runner and the LoRA adapters. `LLMEngine` steps what this builds; nothing here runs a step."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.cpu_budget import engine_threads
from kvpilot.daemon.engine.kv.cache_manager import KVCacheManager
from kvpilot.daemon.engine.kv.disk_tier import DiskTier, checkpoint_files
from kvpilot.daemon.engine.kv.host_tier import HostTier
from kvpilot.daemon.engine.kv.offload import KVOffload
from kvpilot.daemon.engine.loader import load
from kvpilot.daemon.engine.model_runner import ModelRunner, kv_block_shape, kv_bytes_per_block
from kvpilot.daemon.engine.scheduler import Scheduler
from kvpilot.daemon.engine.weights.lora import LoRAAdapter, LoRARegistry, load_adapter, parse_lora_modules
from kvpilot.daemon.kv_transfer.connector import KVConnector
from kvpilot.kernels import Ops, select_ops
from kvpilot.kv.block_keys import KeyScheme, key_scheme

if TYPE_CHECKING:
    from kvpilot.daemon.engine.kv.publisher import KVEventPublisher
    from kvpilot.daemon.engine.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineParts:
    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    ops: Ops
    model_name: str
    model_dir: Path
    tokenizer: Any  # a transformers tokenizer
    eos_token_ids: frozenset[int]
    num_blocks: int
    max_model_len: int
    kv: KVCacheManager
    scheduler: Scheduler
    loras: LoRARegistry
    runner: ModelRunner
    keys: KeyScheme
    kv_events: KVEventPublisher | None  # None when off: nothing is recorded
    connector: KVConnector | None  # prefill/decode disaggregation (--kv-transfer-config); None when off


def build_engine(config: EngineConfig) -> EngineParts:
    config.validate()
    device = config.torch_device()
    if device.type == "cpu":
        # OpenMP threads that compete for more cores than the container may use spin-wait each other
        # into a 5-10x slower step: follow the affinity mask and the cgroup CPU quota.
        torch.set_num_threads(engine_threads(config.cpu_threads))
    dtype = config.torch_dtype(device)
    ops = select_ops(device, config.kernel_backend)
    loaded = load(config.model, ops, dtype, device)
    model = loaded.model
    tp = None
    if config.tensor_parallel_size > 1:
        from kvpilot.daemon.engine.parallel.tp import TensorParallel

        tp = TensorParallel(config, model, device)  # shards `model`: rank 0 of the group

    compilation = config.compilation(device.type)
    if (
        config.packed_linears is not False
        and device.type == "cpu"
        and not compilation.compiled
        and tp is None
    ):
        start = time.monotonic()
        used = model.pack_linears(copies=config.packed_linears is True)
        if used is not None:
            log.info("linear weights laid out in %.1f s for %s", time.monotonic() - start, used)
        elif config.packed_linears:
            log.info("--packed-linears: no kernel here takes the weights: F.linear throughout")
    num_blocks = config.num_kv_blocks or _blocks_from_memory(config, model, dtype, device)
    if tp is not None:
        tp.share_num_blocks(num_blocks)
    # Pinned blocks are never there for a request: a prompt that needs more than the rest would wait at the
    # head of the queue for blocks no eviction frees, and every request behind it with it.
    pin_cap = int(num_blocks * (config.pin_ratio or 0))
    pool_tokens = (num_blocks - pin_cap) * config.block_size
    max_model_len = min(config.max_model_len or model.args.max_position, model.args.max_position)
    if pool_tokens < max_model_len:
        pinned = f" besides the {pin_cap} blocks pins may hold" if pin_cap else ""
        log.warning(
            "KV pool holds %d tokens%s: max_model_len lowered from %d", pool_tokens, pinned, max_model_len
        )
        max_model_len = pool_tokens

    offload = _start_offload(config, model, dtype, loaded.model_dir) if config.offloads_kv else None
    kv = KVCacheManager(
        num_blocks,
        config.block_size,
        config.enable_prefix_caching,
        offload,
        config.prefix_cache_eviction_policy,
        pin_cap,
    )
    scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens, max_model_len)
    scheduler.max_loras = config.max_loras if config.enable_lora else None
    loras = _load_loras(config, model, dtype, device)
    log.info("engine step: %s", compilation.describe())
    runner = ModelRunner(model, num_blocks, config.block_size, dtype, device, compilation)
    if tp is not None:
        runner.on_step = tp.send_step
    keys = key_scheme(config.prefix_caching_hash_algo)
    kv_events = _start_kv_events(config, kv, keys, num_blocks)
    if offload is not None and kv_events is not None:
        offload.on_stored = kv_events.recorder.block_offloaded
        offload.on_removed = kv_events.recorder.block_removed
    transfer = config.kv_transfer
    connector = None
    if transfer is not None:
        connector = KVConnector.of(
            transfer, kv.remote, kv_block_shape(model, config.block_size), dtype, device
        )
    log.info(
        "engine ready: model %s (%s) on %s/%s x %d shard(s), ops=%s, %d torch threads, %d KV blocks x %d tokens (%.0f MiB), max_model_len %d",
        loaded.name,
        loaded.model_dir,
        device,
        str(dtype).removeprefix("torch."),
        config.tensor_parallel_size,
        ops.name,
        torch.get_num_threads(),
        num_blocks,
        config.block_size,
        num_blocks * kv_bytes_per_block(model, config.block_size, dtype) / 2**20,
        max_model_len,
    )
    return EngineParts(
        config,
        device,
        dtype,
        ops,
        loaded.name,
        loaded.model_dir,
        loaded.tokenizer,
        loaded.eos_token_ids,
        num_blocks,
        max_model_len,
        kv,
        scheduler,
        loras,
        runner,
        keys,
        kv_events,
        connector,
    )


def _load_loras(
    config: EngineConfig, model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device
) -> LoRARegistry:
    """The adapters --lora-modules names, each checked against the base model (a bad one stops the start
    with its reason)."""

    def read(name: str, path: str | Path) -> LoRAAdapter:
        return load_adapter(name, path, model, config.max_lora_rank, dtype, device)

    loras = LoRARegistry(read, config.max_cpu_loras)
    if config.enable_lora:
        for name, path in parse_lora_modules(config.lora_modules).items():
            loras.add(read(name, path))
    return loras


def _start_offload(
    config: EngineConfig, model: LlamaForCausalLM, dtype: torch.dtype, model_dir: Path
) -> KVOffload:
    """The tiers below the pool (kv/offload.py); a data-parallel rank gets its share of each and a
    directory of its own."""
    c = config
    shape = kv_block_shape(model, c.block_size)
    block_bytes = kv_bytes_per_block(model, c.block_size, dtype)
    share = c.data_parallel_size
    host = disk = None
    if c.kv_offloading_size is not None:
        host = HostTier(int(c.kv_offloading_size * 2**30) // share, block_bytes)
    if c.kv_offloading_dir is not None:
        root = Path(c.kv_offloading_dir)
        if share > 1:
            root /= f"rank-{c.data_parallel_rank}"
        identity = {"model": str(model_dir), "files": checkpoint_files(model_dir)}
        disk = DiskTier(root, int(c.kv_offloading_dir_size * 2**30) // share, shape, dtype, identity)
    log.info(
        "KV offloading: host %s, disk %s, %.0f KiB a block",
        f"{host.capacity_bytes / 2**30:.2f} GiB" if host else "off",
        f"{disk.root} ({disk.capacity_bytes / 2**30:.2f} GiB, {len(disk)} blocks kept)" if disk else "off",
        block_bytes / 1024,
    )
    return KVOffload(host, disk)


def _start_kv_events(
    config: EngineConfig, kv: KVCacheManager, keys: KeyScheme, num_blocks: int
) -> KVEventPublisher | None:
    if not config.kv_events_endpoint:
        return None
    from kvpilot.daemon.engine.kv.publisher import KVEventPublisher

    publisher = KVEventPublisher(
        config.kv_events_endpoint,
        config.kv_events_replay_endpoint,
        config.block_size,
        rank=config.data_parallel_rank,
        token_ids=config.kv_events_token_ids,
        keys=keys,
        curve_dir=config.kv_events_curve_dir,
        # every block the rank can hold, offload tiers included: a consumer caps its index of this rank at
        # it (router/kv/index.py), and a tier holds blocks the pool no longer does
        blocks_total=num_blocks + (kv.offload.capacity_blocks if kv.offload else 0),
    )
    kv.pool.events = publisher.recorder
    return publisher


def _blocks_from_memory(
    config: EngineConfig, model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device
) -> int:
    per_block = kv_bytes_per_block(model, config.block_size, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_utilization)
    else:
        budget = config.kv_cache_memory_bytes
    return max(1, budget // per_block)
