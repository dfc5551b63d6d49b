"""The engine's KV connector (`--kv-transfer-config`): its role, the holds it keeps as a producer, and what
it landed or refused as a consumer. Built with the engine (`build.py`); the server reads it for replies,
the transfer port and metrics."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpilot.daemon.kv_transfer.config import KVTransferConfig
from kvpilot.daemon.kv_transfer.held import HeldKV
from kvpilot.daemon.kv_transfer.remote import RemoteSource


@dataclass(slots=True)
class KVConnector:
    config: KVTransferConfig
    held: HeldKV | None  # a producer's holds (None: a consumer only)
    remote: RemoteSource  # a consumer's landings (the cache manager counts them)
    block_shape: tuple[int, ...]  # one block of every layer: [layers, K/V, block_size, kv_heads, head_dim]
    dtype: torch.dtype
    pinned: bool  # pulls land in pinned host memory (a CUDA pool: its copies in queue on the step's stream)
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # vLLM's remote_engine_id
    port: int | None = None  # the transfer port, once the server listens (a producer)
    pulls_in_flight: int = 0  # a consumer's pulls under way (counted on the server's event loop)

    @classmethod
    def of(
        cls,
        config: KVTransferConfig,
        remote: RemoteSource,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVConnector:
        held = HeldKV(config.hold_timeout_s, config.max_held_bytes) if config.produces else None
        return cls(config, held, remote, block_shape, dtype, pinned=device.type == "cuda")

    def describe(self) -> dict[str, Any]:
        """`/prefix_cache`'s `kv_transfer`: the role, the holds waiting for a pull, what landed."""
        out: dict[str, Any] = {"role": self.config.role, "engine_id": self.engine_id}
        if self.held is not None:
            h = self.held.stats()
            out["port"] = self.port
            out["held"] = {"transfers": h.transfers, "blocks": h.blocks, "bytes": h.bytes, "epoch": h.epoch}
            out["held_dropped"] = h.dropped
        if self.config.consumes:
            out["pulls_in_flight"] = self.pulls_in_flight
            out["landed_blocks"] = self.remote.landed_blocks
            out["refused"] = dict(self.remote.refused)
        return out
