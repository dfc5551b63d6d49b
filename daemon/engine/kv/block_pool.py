"""The fixed pool of KV blocks, its free list and the prefix index.

Every block is in exactly one state: `used` (ref_cnt > 0), `cached` (free, and reachable through a live
prefix index) or `free` (free and unreachable). Free and cached blocks wait in the eviction order
(`--prefix-cache-eviction-policy`): unreachable blocks are reused first, then the cached block the policy
names (LRU: the least recently used; LFU: the least often hit). A pinned block (`pin_prefix`) holds a
reference of its own, so it is never in the eviction order (never evicted, never offloaded) until it is
unpinned or a reset drops it.

The prefix index is one map per cache scope (the weights, adapter and salt a block was computed under:
`cache_scope.py`). `reset()` makes every cached block unreachable in O(1): it drops every scope's map and
bumps the epoch. `reset_scopes()` drops the maps of the scopes it names, in O(1) per scope, and leaves the
others warm. Blocks still carry their old key and map; a key only counts while its map is live and maps
it to that very block, so stale keys are harmless and are dropped lazily when the block is reused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpilot.daemon.engine.kv.cache_scope import CacheScope
from kvpilot.kv.block_keys import BlockHash
from kvpilot.protocol.pins import PinResult

if TYPE_CHECKING:
    from kvpilot.daemon.engine.kv.recorder import KVEventRecorder


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    index: ScopeIndex | None = None  # the map that indexed it, while block_hash is set
    hits: int = 0  # prefix-cache hits since it was allocated (LFU's count)
    pinned: bool = False  # holds a reference of its pin (BlockPool.pin)
    queue: FreeBlockQueue | None = field(default=None, repr=False)  # LFU: the queue it waits in
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
        # The sentinel tail's prev is always a block (the head when empty); no check on this hot path.
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


class LRUOrder:
    """One queue: unreachable blocks at the head, reused first; cached ones appended at the tail as they
    are freed, so the least recently used is evicted first. A reset leaves dead blocks where they are:
    they are taken as they come up."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._queue = FreeBlockQueue(blocks)

    def __len__(self) -> int:
        return len(self._queue)

    def push_free(self, block: KVBlock) -> None:
        self._queue.appendleft(block)

    def push_cached(self, block: KVBlock) -> None:
        self._queue.append(block)

    def remove(self, block: KVBlock) -> None:
        self._queue.remove(block)

    def pop(self) -> KVBlock:
        return self._queue.popleft()

    def reset(self) -> None:
        pass  # every cached block sits behind the head's free ones and ahead of what is cached next

    def block_ids(self) -> list[int]:
        """In eviction order (O(blocks): for tests and checks)."""
        return self._queue.block_ids()


class LFUOrder:
    """Unreachable blocks first; then cached blocks by how often they were hit, in classes of powers of
    two (0 hits, 1, 2-3, 4-7, ...: a handful of queues, so an eviction looks at a few queue heads), least
    recently freed first within a class. A full reset moves every class ahead of the live ones at once:
    their blocks are dead however often they were hit."""

    CLASSES = 16

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._free = FreeBlockQueue([])
        self._dead: list[FreeBlockQueue] = []  # the classes of before the last resets, oldest first
        self._classes = [FreeBlockQueue([]) for _ in range(self.CLASSES)]
        self._len = 0
        for b in blocks:
            self.push_free(b)

    def __len__(self) -> int:
        return self._len

    def push_free(self, block: KVBlock) -> None:
        self._free.appendleft(block)
        block.queue = self._free
        self._len += 1

    def push_cached(self, block: KVBlock) -> None:
        queue = self._classes[min(block.hits.bit_length(), self.CLASSES - 1)]
        queue.append(block)
        block.queue = queue
        self._len += 1

    def remove(self, block: KVBlock) -> None:
        assert block.queue is not None, "block is not in the eviction order"
        block.queue.remove(block)
        block.queue = None
        self._len -= 1

    def pop(self) -> KVBlock:
        while self._dead and not self._dead[0]:
            del self._dead[0]
        queue = next((q for q in (self._free, *self._dead[:1], *self._classes) if q), None)
        if queue is None:
            raise IndexError("no free blocks")
        block = queue.popleft()
        block.queue = None
        self._len -= 1
        return block

    def reset(self) -> None:
        self._dead.extend(q for q in self._classes if q)
        self._classes = [FreeBlockQueue([]) for _ in range(self.CLASSES)]

    def block_ids(self) -> list[int]:
        """In eviction order (O(blocks): for tests and checks)."""
        return [i for q in (self._free, *self._dead, *self._classes) for i in q.block_ids()]


@dataclass(slots=True, eq=False)
class ScopeIndex:
    """One scope's prefix index. Live while it is its pool's map for the scope (a reset of it, or of
    everything, replaces it); a request's KV is indexed only into the map it began in, while that is
    live. A map that holds no block and no request is dropped, so the scopes kept are bounded by the
    blocks and requests, whatever salts clients send."""

    scope: CacheScope
    blocks: dict[BlockHash, KVBlock] = field(default_factory=dict)
    cached_free: int = 0  # of its blocks, those in the free queue
    holders: int = 0  # requests whose KV began in it


class BlockPool:
    def __init__(self, num_blocks: int, eviction_policy: str = "lru", pin_cap: int = 0) -> None:
        """`pin_cap`: the most blocks requests may pin (0: pinning is off)."""
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.eviction_policy = eviction_policy
        self._free = LFUOrder(self.blocks) if eviction_policy == "lfu" else LRUOrder(self.blocks)
        self.pin_cap = pin_cap
        self._pinned: dict[KVBlock, None] = {}  # in pin order
        self.pins_refused = 0
        self._scopes: dict[CacheScope, ScopeIndex] = {}
        self._num_cached_free = 0
        self._retired: list[dict[BlockHash, KVBlock]] = []  # maps dropped by resets, freed after it answered
        self.epoch = 0
        self.events: KVEventRecorder | None = None  # set when KV events are published
        # Told of each cached block evicted by an allocation, before anything overwrites it (the
        # offload tiers keep it: kv/offload.py).
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

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._pinned)

    def is_cached(self, block: KVBlock) -> bool:
        index = block.index
        return (
            block.block_hash is not None
            and index is not None
            and self.is_live(index)
            and index.blocks.get(block.block_hash) is block
        )

    def is_live(self, index: ScopeIndex) -> bool:
        return self._scopes.get(index.scope) is index

    # ---- prefix index ------------------------------------------------------------------------
    def lookup(self, scope: CacheScope, block_hash: BlockHash) -> KVBlock | None:
        index = self._scopes.get(scope)
        return None if index is None else index.blocks.get(block_hash)

    def indexed_keys(self) -> set[BlockHash]:
        """Every key a lookup finds now, in every scope (O(blocks): for tests and checks, not steps)."""
        return {key for index in self._scopes.values() for key in index.blocks}

    def open_index(self, scope: CacheScope) -> ScopeIndex:
        """The live map of `scope` (made on first use), for a request whose KV begins now."""
        index = self._scopes.get(scope)
        if index is None:
            index = self._scopes[scope] = ScopeIndex(scope)
        index.holders += 1
        return index

    def close_index(self, index: ScopeIndex) -> None:
        """The request that opened it is done with it."""
        index.holders -= 1
        self._prune(index)

    def _prune(self, index: ScopeIndex) -> None:
        if not index.blocks and index.holders == 0 and self.is_live(index):
            del self._scopes[index.scope]

    def cache_block(self, block: KVBlock, index: ScopeIndex, block_hash: BlockHash) -> bool:
        """Index a full, computed, in-use block in `index` (live); True if the key is new. A key that is
        already indexed keeps its first block."""
        assert block.ref_cnt > 0, "only blocks held by a request are indexed"
        assert self.is_live(index), "a dropped index takes no blocks"
        if block_hash in index.blocks:
            return False
        index.blocks[block_hash] = block
        block.block_hash, block.index = block_hash, index
        return True

    def reset(self) -> int:
        """Make every indexed block unreachable at once; returns how many were reachable."""
        evicted = sum(len(i.blocks) for i in self._scopes.values())
        for index in self._scopes.values():
            self._retire(index)
        self._scopes = {}
        self._num_cached_free = 0
        self._free.reset()
        self.epoch += 1
        if self.events is not None:
            self.events.all_cleared()
        return evicted

    def reset_scopes(self, match: Callable[[CacheScope], bool]) -> int:
        """Make the blocks of the scopes `match` names unreachable, a map at a time (O(1) each, O(scopes)
        to find them); returns how many were reachable. Their keys go out as BlockRemoved events: a
        router drops those and nothing else."""
        evicted = 0
        for scope in [s for s in self._scopes if match(s)]:
            index = self._scopes.pop(scope)
            evicted += len(index.blocks)
            self._num_cached_free -= index.cached_free
            if self.events is not None:
                for key in index.blocks:
                    self.events.block_removed(key)
            self._retire(index)
        return evicted

    def _retire(self, index: ScopeIndex) -> None:
        """Freeing a dict of 100k keys takes milliseconds: park a dropped map's and let release_retired()
        free it after the reset has answered (its blocks still point at the emptied index, dead anyway)."""
        self._retired.append(index.blocks)
        index.blocks = {}

    def release_retired(self) -> None:
        self._retired.clear()

    # ---- pins --------------------------------------------------------------------------------
    def pin(self, blocks: list[KVBlock]) -> PinResult:
        """Pin cached blocks, all or none: none when that would pin more than `pin_cap` blocks. A pinned
        block keeps a reference of its own until `unpin` (one that waited in the eviction order leaves it)."""
        if not self.pin_cap:
            return PinResult(False, reason="disabled")
        new = [b for b in blocks if not b.pinned]
        if len(self._pinned) + len(new) > self.pin_cap:
            self.pins_refused += 1
            return PinResult(False, reason="cap")
        for b in new:
            assert self.is_cached(b), "only cached blocks are pinned"
            self.touch([b], hit=False)
            b.pinned = True
            self._pinned[b] = None
        return PinResult(True, len(blocks))

    def unpin(self, match: Callable[[CacheScope], bool] | None = None) -> int:
        """Let go of every pin (or those of the scopes `match` names); how many. An unpinned block that is
        still cached waits in the eviction order like any other; one a reset dropped is free."""
        chosen = [b for b in self._pinned if match is None or (b.index is not None and match(b.index.scope))]
        for b in chosen:
            del self._pinned[b]
            b.pinned = False
            self.free([b])
        return len(chosen)

    # ---- allocation --------------------------------------------------------------------------
    def touch(self, blocks: list[KVBlock], hit: bool = True) -> None:
        """Take a reference on prefix-cache hits (a free cached block leaves the free queue); `hit` False
        for a reference that is no hit (a fork sharing its parent's blocks, a pin), which LFU must not
        count."""
        for b in blocks:
            b.hits += hit
            if b.ref_cnt == 0:
                self._free.remove(b)
                if self.is_cached(b):
                    self._num_cached_free -= 1
                    # is_cached: the block has its index (not re-checked on this hot path)
                    b.index.cached_free -= 1  # type: ignore[union-attr]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            b = self._free.pop()
            if b.block_hash is not None:
                if self.is_cached(b):  # evicting the least recently used cached block
                    # is_cached: `index` is set (the ignores below; not re-checked on this hot path)
                    index = b.index
                    del index.blocks[b.block_hash]  # type: ignore[union-attr]
                    index.cached_free -= 1  # type: ignore[union-attr]
                    self._num_cached_free -= 1
                    if self.events is not None:
                        self.events.block_removed(b.block_hash)
                    if self.on_evict is not None:
                        self.on_evict(b, b.block_hash)
                    self._prune(index)  # type: ignore[arg-type]
                b.block_hash = b.index = None
            b.ref_cnt, b.hits = 1, 0
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
                self._free.push_cached(b)
                self._num_cached_free += 1
                # is_cached: the block has its index (not re-checked on this hot path)
                b.index.cached_free += 1  # type: ignore[union-attr]
            else:
                b.block_hash = b.index = None  # a stale key from a dropped map must never come back
                self._free.push_free(b)
