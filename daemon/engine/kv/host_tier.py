"""The host-memory tier below the pool: evicted blocks kept by key in an LRU bounded in bytes (the
tiers as a whole: offload.py)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpilot.daemon.engine.kv.cache_scope import CacheScope
from kvpilot.daemon.engine.outputs import TierStats
from kvpilot.kv.block_keys import BlockHash

HOST = "host"


@dataclass(slots=True)
class HostBlock:
    """One block's K and V of every layer, [layers, 2, block_size, kv_heads, head_dim], in host memory.
    `ready` (a CUDA event) is set once the copy off the GPU has landed; None on the CPU."""

    data: torch.Tensor
    ready: torch.cuda.Event | None = None
    scope: CacheScope | None = None  # what it was computed under, for scoped resets

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


class HostTier:
    name = HOST

    def __init__(self, capacity_bytes: int, block_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self._blocks: OrderedDict[BlockHash, HostBlock] = OrderedDict()
        self.hit_tokens = self.stored_blocks = self.loaded_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: BlockHash) -> HostBlock | None:
        return self._blocks.get(key)

    def discard(self, key: BlockHash) -> bool:
        return self._blocks.pop(key, None) is not None

    def put(self, key: BlockHash, block: HostBlock) -> list[tuple[BlockHash, HostBlock]]:
        """Store a block; returns the least recently stored ones pushed out to stay within capacity."""
        self._blocks[key] = block
        self._blocks.move_to_end(key)
        self.stored_blocks += 1
        out = []
        while len(self._blocks) * self.block_bytes > self.capacity_bytes:
            out.append(self._blocks.popitem(last=False))
        return out

    def reset(self) -> int:
        n = len(self._blocks)
        self._blocks = OrderedDict()  # the old map and its tensors go with the last reference
        return n

    def reset_scopes(self, match: Callable[[CacheScope], bool]) -> list[BlockHash]:
        """Drop the blocks of the scopes `match` names; returns their keys."""
        gone = [k for k, b in self._blocks.items() if b.scope is not None and match(b.scope)]
        for k in gone:
            del self._blocks[k]
        return gone

    def stats(self) -> TierStats:
        return TierStats(
            HOST,
            len(self._blocks),
            len(self._blocks) * self.block_bytes,
            self.capacity_bytes,
            self.hit_tokens,
            self.stored_blocks,
            self.loaded_blocks,
        )
