"""Records the KV events of one engine step, in order, on the engine's thread (no I/O): the block pool
and the cache manager call it as blocks enter and leave the prefix index; the publisher drains it once per
step (kv/publisher.py). The events and their limits are the wire format's (kvpilot/kv/events.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.kv.block_keys import BlockHash
from kvpilot.kv.events import MAX_EVENT_BLOCKS, MEDIUM, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(slots=True)
class KVEventRecorder:
    """Collects one step's events in order; the block pool and the cache manager call it."""

    block_size: int
    token_ids: bool = False  # publish each block's token ids (--kv-events-token-ids); else []
    events: list[KVEvent] = field(default_factory=list)
    weight_version: str | None = None  # the named weights' version, told with each AllBlocksCleared

    def block_stored(
        self, chain: list[BlockHash], i: int, token_ids: list[int], lora_name: str | None = None
    ) -> None:
        """Block `i` of a request whose keys are `chain` (computed under the adapter `lora_name`) was
        indexed; consecutive blocks of one chain stored in the same step travel as one BlockStored, as
        in vLLM (one chain has one adapter: its first key names it)."""
        bs = self.block_size
        tokens = token_ids[i * bs : (i + 1) * bs] if self.token_ids else []
        parent = chain[i - 1] if i > 0 else None
        last = self.events[-1] if self.events else None
        if (
            isinstance(last, BlockStored)
            and last.medium == MEDIUM
            and parent is not None
            and last.block_hashes[-1] == parent
            and len(last.block_hashes) < MAX_EVENT_BLOCKS
        ):
            last.block_hashes.append(chain[i])
            last.token_ids.extend(tokens)
        else:
            self.events.append(BlockStored([chain[i]], parent, list(tokens), bs, lora_name=lora_name))

    def block_removed(self, block_hash: BlockHash, medium: str = MEDIUM) -> None:
        last = self.events[-1] if self.events else None
        if (
            isinstance(last, BlockRemoved)
            and last.medium == medium
            and len(last.block_hashes) < MAX_EVENT_BLOCKS
        ):
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash], medium))

    def block_offloaded(self, block_hash: BlockHash, medium: str) -> None:
        """A block entered an offload tier (`medium` "CPU" or "STORAGE"): an event of its own, with no
        parent, since blocks leave the pool in LRU order, not as a chain."""
        self.events.append(BlockStored([block_hash], None, [], self.block_size, medium))

    def all_cleared(self) -> None:
        self.events.append(AllBlocksCleared(self.weight_version))

    def drain(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out
