"""Which pod rank holds which prefix block, as the pods' KV events say.

Entries are kept per holder: a (pod name, data-parallel rank) pair in the router, since each rank of a
data-parallel pod has its own KV cache and its own event stream (any hashable names one). A holder's entry
is exactly the set of block keys its engine has indexed, kept by applying its events in sequence order
(stored adds, removed drops, all-cleared empties). When events were lost and cannot be replayed, the pod's
entry is emptied and rebuilt from the events that follow: from then on it holds a subset of the truth, so
the router may under-predict a hit but never predicts one that is not there.

What a pod sends is bounded here, whatever it sends:
- a block hash is kept only if it is one of kvpilot's keys (32 bytes, `block_hash.py`); anything else is
  skipped (it can name no block the router would look up, so skipping it loses nothing);
- a holder's entry never holds more keys than the rank's pool has blocks (`set_capacity`, from the pod's
  advertised `blocks_total`, at most `MAX_BLOCKS_PER_HOLDER`): a stream that would go past it no longer
  matches any pool, so the entry is emptied and rebuilt from the events that follow.

Memory: each key is kept as the integer of its first 16 bytes in a per-holder set (about 80-110 B per key
with CPython's set and int layouts; `bench/index_memory.py` measures it). 128 bits of a sha256 digest
keep accidental collisions out of reach (the birthday bound is 2**64 keys), and a collision could only
mis-predict a cache hit, never change what a pod computes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable, Iterable

from kvpilot.daemon.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

log = logging.getLogger(__name__)

Holder = Hashable  # (pod name, rank) in the router
HASH_BYTES = 32  # a kvpilot block key: a sha256 digest
KEY_BYTES = 16  # what the index keeps of it
# Blocks one holder may hold whatever its pod advertises: a rank with 2M blocks of 16 tokens caches 32M
# tokens, far beyond any one accelerator's KV memory today; it bounds a lying pod at ~230 MB.
MAX_BLOCKS_PER_HOLDER = 1 << 21


def index_key(block_hash: object) -> int | None:
    """The index's key for a block hash; None for anything that is not a 32-byte kvpilot key."""
    if type(block_hash) is not bytes or len(block_hash) != HASH_BYTES:
        return None
    return int.from_bytes(block_hash[:KEY_BYTES], "big")


class PrefixIndex:
    def __init__(self) -> None:
        self._blocks: dict[Holder, set[int]] = {}  # holder -> keys it holds
        self._capacity: dict[Holder, int] = {}  # holder -> most keys it can hold (its pool's blocks)
        self._clears: dict[Holder, int] = {}  # holder -> AllBlocksCleared events applied so far
        self._distrusted: set[Holder] = set()  # holders whose entries stay empty until their next clear
        self._refused: set[Holder] = set()  # holders already warned about for hashes of the wrong form
        self._cleared = asyncio.Event()  # set (and replaced) whenever a holder reports AllBlocksCleared

    # ---- updates -------------------------------------------------------------------------------
    def set_capacity(self, holder: Holder, blocks: int | None) -> None:
        """The most blocks `holder` can hold: its pool's size (None: not known, the router's ceiling)."""
        cap = MAX_BLOCKS_PER_HOLDER if blocks is None else max(1, min(blocks, MAX_BLOCKS_PER_HOLDER))
        self._capacity[holder] = cap
        if self.num_blocks(holder) > cap:
            self.clear(holder)

    def apply(self, holder: Holder, batch: EventBatch) -> None:
        for ev in batch.events:
            if holder in self._distrusted and not isinstance(ev, AllBlocksCleared):
                continue
            if isinstance(ev, BlockStored):
                self.store(holder, ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.remove(holder, ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.clear(holder)
                self._distrusted.discard(holder)
                self._clears[holder] = self._clears.get(holder, 0) + 1
                self._cleared.set()
                self._cleared = asyncio.Event()

    def store(self, holder: Holder, hashes: Iterable[object]) -> None:
        held = self._blocks.setdefault(holder, set())
        cap = self._capacity.get(holder, MAX_BLOCKS_PER_HOLDER)
        for h in hashes:
            k = index_key(h)
            if k is None:
                self._refuse(holder, h)
                continue
            if len(held) >= cap and k not in held:
                # More blocks than the pool has: events were lost or the pod is lying. Start over.
                log.warning("%s: more than its %d blocks indexed; emptying its entry", holder, cap)
                held.clear()
            held.add(k)

    def remove(self, holder: Holder, hashes: Iterable[object]) -> None:
        held = self._blocks.get(holder)
        if not held:
            return
        for h in hashes:
            k = index_key(h)
            if k is not None:
                held.discard(k)  # a malformed hash was never stored

    def clear(self, holder: Holder) -> None:
        self._blocks.pop(holder, None)

    def forget(self, holder: Holder) -> None:
        """Drop everything about a holder that left the fleet."""
        self.clear(holder)
        self._capacity.pop(holder, None)
        self._distrusted.discard(holder)
        self._refused.discard(holder)

    def distrust(self, holder: Holder) -> None:
        """Empty the holder's entries and ignore what it stores until it reports AllBlocksCleared: for a
        pod that was reset but whose clear event has not arrived (events sent before the reset may still
        be on their way)."""
        self.clear(holder)
        self._distrusted.add(holder)

    def _refuse(self, holder: Holder, h: object) -> None:
        if holder not in self._refused:  # once per holder: a broken pod would send many
            self._refused.add(holder)
            log.warning(
                "%s: skipped a block hash that is no %d-byte key (%s); others may follow",
                holder,
                HASH_BYTES,
                type(h).__name__,
            )

    # ---- queries -------------------------------------------------------------------------------
    def num_blocks(self, holder: Holder) -> int:
        return len(self._blocks.get(holder, ()))

    def blocks_of(self, holders: Iterable[Holder]) -> int:
        """Blocks indexed for a pod: its ranks' entries together."""
        return sum(self.num_blocks(h) for h in holders)

    def clears(self, holder: Holder) -> int:
        return self._clears.get(holder, 0)

    def matched_blocks(self, hashes: list[bytes], holders: Iterable[Holder]) -> dict[Holder, int]:
        """For each holder, how many leading block hashes it holds without a gap (the engine stops at its
        first miss too)."""
        out = {h: 0 for h in holders}
        alive = [(h, held) for h in out if (held := self._blocks.get(h))]
        for i, block_hash in enumerate(hashes):
            k = index_key(block_hash)
            alive = [(h, held) for h, held in alive if k in held]
            if not alive:
                break
            for h, _ in alive:
                out[h] = i + 1
        return out

    async def wait_cleared(self, holder: Holder, after: int, timeout: float) -> bool:
        """True once `holder` has reported more than `after` AllBlocksCleared events (within `timeout`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.clears(holder) <= after:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._cleared.wait(), remaining)
            except TimeoutError:
                return False
        return True
