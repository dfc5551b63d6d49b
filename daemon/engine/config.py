"""Engine settings; the CLI flags of `kvpilot serve` map onto these one to one."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # checkpoint directory; None is the embedded default model
    dtype: str = "auto"  # auto: float32 on the CPU (no native bf16 there), bfloat16 on CUDA
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides the memory-derived block count
    kv_cache_memory_bytes: int = 1 << 30  # KV budget on the CPU
    gpu_memory_utilization: float = 0.85  # share of free GPU memory the KV cache may take
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's own context length
    enable_prefix_caching: bool = True
    max_queued_requests: int | None = 1024  # waiting requests beyond which new ones are refused (503)
    cpu_threads: int | None = (
        None  # torch threads on the CPU; None: usable CPUs (affinity, cgroup quota) but one
    )
    kernel_backend: str | None = None  # None: triton on CUDA, torch elsewhere ($KVPILOT_KERNELS)
    kv_events_endpoint: str | None = None  # ZeroMQ PUB address for KV events (kv_events.py); None: off
    kv_events_replay_endpoint: str | None = None  # ZeroMQ ROUTER address serving missed events again
    tensor_parallel_size: int = 1  # processes the model is sharded over (tp.py)

    def validate(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError("block_size must be a power of two between 1 and 128")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError("max_queued_requests must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be positive")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("a KV events replay endpoint needs a KV events endpoint")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError("dtype must be auto, float32, bfloat16 or float16")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)
