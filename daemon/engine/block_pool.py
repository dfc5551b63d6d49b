"""The fixed pool of KV blocks, its free list and the prefix index.

Every block is in exactly one state: `used` (ref_cnt > 0), `cached` (free, and reachable through the
prefix index of the current epoch) or `free` (free and unreachable). Free and cached blocks both sit in
one doubly linked free queue: unreachable blocks at the head so they are reused first, cached blocks
appended at the tail so the least recently used one is evicted first.

`reset()` makes every cached block unreachable in O(1): it swaps the index for an empty one and bumps
the epoch. Blocks still carry their old key; a key only counts while the current index maps it to that
very block, so stale keys are harmless and are dropped lazily when the block is reused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpilot.block_keys import BlockHash

if TYPE_CHECKING:
    from kvpilot.daemon.engine.kv_recorder import KVEventRecorder


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev: KVBlock | None = field(default=None, repr=False)
    next: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of blocks with O(1) push at either end, pop from the head and removal."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self._len

    def append(self, block: KVBlock) -> None:
        self._insert_after(self._tail.prev, block)  # type: ignore[arg-type]

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        assert block.prev is not None and block.next is not None, "block is not in the free queue"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self._len -= 1

    def _insert_after(self, anchor: KVBlock, block: KVBlock) -> None:
        assert block.prev is None and block.next is None, "block is already in the free queue"
        nxt = anchor.next
        assert nxt is not None
        anchor.next, block.prev, block.next, nxt.prev = block, anchor, nxt, block
        self._len += 1

    def block_ids(self) -> list[int]:
        out, b = [], self._head.next
        while b is not None and b is not self._tail:
            out.append(b.block_id)
            b = b.next
        return out


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free = FreeBlockQueue(self.blocks)
        self._index: dict[BlockHash, KVBlock] = {}
        self._num_cached_free = 0
        self._retired: list[dict[BlockHash, KVBlock]] = []
        self.epoch = 0
        self.events: KVEventRecorder | None = None  # set when KV events are published
        # Told of each cached block evicted by an allocation, before anything overwrites it (the
        # offload tiers keep it: kv_offload.py).
        self.on_evict: Callable[[KVBlock, BlockHash], None] | None = None

    # ---- state -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation may take: free plus cached."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def is_cached(self, block: KVBlock) -> bool:
        return block.block_hash is not None and self._index.get(block.block_hash) is block

    # ---- prefix index ------------------------------------------------------------------------
    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self._index.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Index a full, computed, in-use block; True if the key is new. A key that is already indexed
        keeps its first block."""
        assert block.ref_cnt > 0, "only blocks held by a request are indexed"
        if block_hash in self._index:
            return False
        self._index[block_hash] = block
        block.block_hash = block_hash
        return True

    def reset(self) -> int:
        """Make every indexed block unreachable at once; returns how many were reachable."""
        evicted = len(self._index)
        # Freeing a dict of 100k keys takes milliseconds: park it and let release_retired() free it
        # after the reset has answered.
        self._retired.append(self._index)
        self._index = {}
        self._num_cached_free = 0
        self.epoch += 1
        if self.events is not None:
            self.events.all_cleared()
        return evicted

    def release_retired(self) -> None:
        self._retired.clear()

    # ---- allocation --------------------------------------------------------------------------
    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on prefix-cache hits (a free cached block leaves the free queue)."""
        for b in blocks:
            if b.ref_cnt == 0:
                self._free.remove(b)
                if self.is_cached(b):
                    self._num_cached_free -= 1
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            b = self._free.popleft()
            if b.block_hash is not None:
                if self.is_cached(b):  # evicting the least recently used cached block
                    del self._index[b.block_hash]
                    self._num_cached_free -= 1
                    if self.events is not None:
                        self.events.block_removed(b.block_hash)
                    if self.on_evict is not None:
                        self.on_evict(b, b.block_hash)
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block. Pass a request's blocks in order: they are released in
        reverse, so the tail of a prefix is evicted before its head (the head is the more shared)."""
        for b in reversed(blocks):
            assert b.ref_cnt > 0, f"block {b.block_id} freed twice"
            b.ref_cnt -= 1
            if b.ref_cnt > 0:
                continue
            if self.is_cached(b):
                self._free.append(b)
                self._num_cached_free += 1
            else:
                b.block_hash = None  # a stale key from an earlier epoch must never come back
                self._free.appendleft(b)
