"""The second KV tier: blocks the pool evicts stay in host memory and, past that, on disk; a prefix that
misses the pool but hits here is copied back into the pool instead of being computed again.

Each tier is an LRU map from the pool's own block key (`block_keys.py`) to the block's K and V for every
layer, bounded in bytes. The tiers and the pool never hold one key twice: a block copied back leaves its
tier, a key the pool indexes again is dropped from the tiers, and a block the host tier evicts moves to the
disk tier. A reset empties every tier in O(1): the host tier swaps its map for an empty one (as the pool
does), the disk tier starts a new generation directory, and a disk write still in flight from before the
reset lands in the old generation, which is never read again (`DiskTier`). A scoped reset (one adapter,
salt or weight version: `cache_scope.py`) drops that scope's blocks from the host tier, O(blocks held
there), and from the disk tier, whose directory per scope it renames away (O(1) on disk, O(blocks held)
in its index).

Copies: the block's data is gathered off the pool before the step's forward pass can overwrite it (on a
GPU, into pinned host memory on a side stream the step does not wait for; on the CPU the gather is that
copy). Disk writes run on a worker thread; a step never waits for one.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait

from kvpilot.daemon.engine.kv.cache_scope import CacheScope
from kvpilot.daemon.engine.kv.disk_tier import DISK, DiskTier, Prefetch
from kvpilot.daemon.engine.kv.host_tier import HOST, HostBlock, HostTier
from kvpilot.daemon.engine.outputs import TierStats
from kvpilot.kv.block_keys import BlockHash

# The tiers' names in KV events, as vLLM names the media of its offloading connector.
MEDIUM = {HOST: "CPU", DISK: "STORAGE"}


class KVOffload:
    """The tiers below the pool, host then disk (either may be off), as the cache manager sees them."""

    def __init__(
        self,
        host: HostTier | None,
        disk: DiskTier | None,
        on_stored: Callable[[BlockHash, str], None] | None = None,
        on_removed: Callable[[BlockHash, str], None] | None = None,
    ) -> None:
        self.tiers: tuple[HostTier | DiskTier, ...] = tuple(t for t in (host, disk) if t is not None)
        self.host, self.disk = host, disk
        self._prefetches: dict[str, Prefetch] = {}  # request id -> its disk read on its way
        # KV events (medium per tier); the engine sets them when it publishes events.
        self.on_stored, self.on_removed = on_stored, on_removed

    @property
    def capacity_blocks(self) -> int:
        return sum(t.capacity_bytes // t.block_bytes for t in self.tiers)

    def find(
        self, request_id: str, keys: list[BlockHash]
    ) -> list[tuple[HostTier | DiskTier, BlockHash, HostBlock]] | None:
        """The longest run of `keys` (the rest of a prefix the pool missed) held in the tiers: host first,
        then disk. Disk blocks are read off the engine's thread: the first call starts the read and
        answers None (the request waits, the step goes on without it); a later one takes the blocks."""
        found: list[tuple[HostTier | DiskTier, BlockHash, HostBlock]] = []
        host, disk = self.host, self.disk
        while host is not None and len(found) < len(keys) and (b := host.get(keys[len(found)])) is not None:
            found.append((host, keys[len(found)], b))
        rest = keys[len(found) :]
        if disk is None or not rest or rest[0] not in disk:
            return found
        pending = self._prefetches.get(request_id)
        if pending is None or pending.first != rest[0] or pending.generation != disk.generation:
            self._prefetches[request_id] = disk.prefetch(rest)
            return None
        if not pending.future.done():
            return None
        del self._prefetches[request_id]
        return found + [(disk, k, b) for k, b in zip(rest, pending.future.result())]

    def wait_for_reads(self, timeout: float) -> None:
        """A step with nothing to run but requests waiting on disk: wait for a read, not spin."""
        if self._prefetches:
            wait([p.future for p in self._prefetches.values()], timeout, FIRST_COMPLETED)

    def forget(self, request_id: str) -> None:
        """The request left the queue: drop a read it no longer needs."""
        self._prefetches.pop(request_id, None)

    def take(self, tier: HostTier | DiskTier, key: BlockHash) -> None:
        """The block was copied back into the pool: it leaves its tier."""
        if tier.discard(key):
            tier.loaded_blocks += 1
            self._removed(key, tier.name)

    def store(self, key: BlockHash, block: HostBlock) -> None:
        """A block the pool evicted: into the host tier (its overflow to disk), or straight to disk."""
        if self.host is None:
            # an offload without a host tier has a disk tier (it is made only with one of them)
            self.disk.put(key, block)  # type: ignore[union-attr]
            return
        pushed_out = self.host.put(key, block)
        self._stored(key, HOST)
        for old_key, old in pushed_out:
            self._removed(old_key, HOST)
            if self.disk is not None:
                self.disk.put(old_key, old)

    def discard(self, key: BlockHash) -> None:
        """The pool indexed this key again (computed anew): no tier keeps a second copy."""
        if self.host is not None and self.host.discard(key):
            self._removed(key, HOST)
        if self.disk is not None and self.disk.discard(key):
            self._removed(key, DISK)

    def reset(self) -> dict[str, int]:
        return {t.name: t.reset() for t in self.tiers}

    def reset_scopes(self, match: Callable[[CacheScope], bool]) -> dict[str, int]:
        """The blocks of those scopes in each tier; each key removed is told to the events (a full reset's
        AllBlocksCleared covers them; a scoped one must name them)."""
        # A disk read made before this reset may hold the scope's blocks: requests ask again.
        self._prefetches.clear()
        out = {}
        if self.host is not None:
            gone = self.host.reset_scopes(match)
            for key in gone:
                self._removed(key, HOST)
            out[HOST] = len(gone)
        if self.disk is not None:
            gone = self.disk.reset_scopes(match)
            for key in gone:
                self._removed(key, DISK)
            out[DISK] = len(gone)
        return out

    def poll(self) -> None:
        """Tell the events what the disk writer did since the last step."""
        if self.disk is None:
            return
        for what, key in self.disk.drain():
            (self._stored if what == "stored" else self._removed)(key, DISK)

    def stats(self) -> tuple[TierStats, ...]:
        return tuple(t.stats() for t in self.tiers)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def _stored(self, key: BlockHash, tier: str) -> None:
        if self.on_stored is not None:
            self.on_stored(key, MEDIUM[tier])

    def _removed(self, key: BlockHash, tier: str) -> None:
        if self.on_removed is not None:
            self.on_removed(key, MEDIUM[tier])
