"""Between the scheduler and the block pool: which blocks a request holds, hits, caching, reset.

The scheduler asks in tokens ("how much of this prompt is cached?", "room for n more tokens?") and
gets block ids back; it never touches `KVBlock` or the pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpilot.daemon.engine.kv.block_pool import BlockPool, KVBlock, ScopeIndex
from kvpilot.daemon.engine.kv.cache_scope import CacheScope
from kvpilot.daemon.engine.kv.disk_tier import DiskTier
from kvpilot.daemon.engine.kv.host_tier import HostBlock, HostTier
from kvpilot.daemon.engine.kv.offload import KVOffload
from kvpilot.daemon.engine.request import Request
from kvpilot.daemon.kv_transfer.remote import RemoteSource
from kvpilot.kv.block_keys import BlockHash
from kvpilot.protocol.pins import PinResult


@dataclass(frozen=True, slots=True)
class TierHit:
    """A block found in an offload tier, or pulled from a prefill pod, to be copied into the pool."""

    tier: HostTier | DiskTier | RemoteSource
    key: BlockHash
    block: HostBlock


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Cached blocks found for a waiting request, to pass back into `allocate_slots`: `blocks` in the
    pool, then `loaded` (pulled from a prefill pod, then from the offload tiers); `num_tokens` counts both."""

    blocks: tuple[KVBlock, ...]
    num_tokens: int
    loaded: tuple[TierHit, ...] = ()
    pending: bool = False  # more of the prefix is being read from disk: admit the request later


NO_HIT = PrefixHit((), 0)


@dataclass(slots=True)
class KVTransfers:
    """Block copies between the offload tiers and the pool that one step must make before its forward
    pass: `saves` (pool block ids evicted this step, to read before anything overwrites them, with their
    keys and scopes) first, then `loads` (pool block ids and the data to write there)."""

    saves: list[tuple[int, BlockHash, CacheScope]]
    loads: list[tuple[int, HostBlock]]

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        offload: KVOffload | None = None,
        eviction_policy: str = "lru",
        pin_cap: int = 0,
    ) -> None:
        """`pin_cap`: the most blocks requests may pin (0: pinning is off)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, eviction_policy, pin_cap if enable_prefix_caching else 0)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_indexed: dict[str, int] = {}
        # The prefix index each request's KV began in: its blocks are indexed there while it is live.
        self._indexes: dict[str, ScopeIndex] = {}
        self.query_tokens = 0
        self.hit_tokens = 0
        self.generation = 0  # resets made, of any scope: a pull planned before one never lands after it
        self.remote = RemoteSource()  # blocks pulled from prefill pods (kv_transfer/remote.py)
        # (source, destination) block copies the model runner must make before the next forward pass.
        self.pending_copies: list[tuple[int, int]] = []
        self.offload = offload if enable_prefix_caching else None
        self._transfers = KVTransfers([], [])
        if self.offload is not None:
            # an evicted block was cached, so it has its index (not re-checked for each eviction)
            self.pool.on_evict = lambda block, key: self._transfers.saves.append(
                (block.block_id, key, block.index.scope)  # type: ignore[union-attr]
            )

    @property
    def epoch(self) -> int:
        return self.pool.epoch

    def find_prefix(self, req: Request) -> PrefixHit:
        """Longest run of cached full blocks that starts the request's tokens.

        At least the last token is always left to compute: the model must run on it to sample.
        """
        if not self.enable_prefix_caching or req.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt position: recompute rather than hit.
            return NO_HIT
        req.update_block_hashes(self.block_size)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        scope = req.cache_scope
        for h in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(scope, h)
            if block is None:
                break
            hits.append(block)
        loaded = self._remote_hits(req, len(hits), max_blocks) if req.remote_kv is not None else []
        if self.offload is not None:  # the prefix goes on in the tiers below the pool
            found = self.offload.find(req.request_id, req.block_hashes[len(hits) + len(loaded) : max_blocks])
            if found is None:
                return PrefixHit(tuple(hits), len(hits) * self.block_size, pending=True)
            loaded += [TierHit(*f) for f in found]
        return PrefixHit(tuple(hits), (len(hits) + len(loaded)) * self.block_size, tuple(loaded))

    def _remote_hits(self, req: Request, have: int, max_blocks: int) -> list[TierHit]:
        """The pulled blocks that go on from the pool's `have` hits, while their keys are the prompt's
        own (kv_transfer/remote.py: a reset since the pull was planned, or a gap, lands none)."""
        remote = req.remote_kv
        assert remote is not None
        refused = None
        if remote.generation != self.generation:
            refused = "local_reset"
        elif have < remote.first:
            refused = "gap"
        if refused is not None:
            self.remote.refuse(refused)
            req.remote_kv = None
            return []
        out = []
        for i in range(have, min(max_blocks, remote.first + len(remote.keys))):
            key = remote.keys[i - remote.first]
            if key != req.block_hashes[i]:
                break
            out.append(TierHit(self.remote, key, HostBlock(remote.data[i - remote.first])))
        return out

    def plan_pull(self, req: Request, remote_keys: list[BlockHash]) -> tuple[int, int, int]:
        """(first, count, matched) of the prefill pod's held blocks `remote_keys`: the request should pull
        `count` from `first`, those after the run the pool already holds, up to where the keys stop being the
        prompt's own (`matched`; another salt, adapter, weights or hash seed: none of them)."""
        req.update_block_hashes(self.block_size)
        own = req.block_hashes[: (req.num_tokens - 1) // self.block_size]
        same = 0
        while same < min(len(own), len(remote_keys)) and own[same] == remote_keys[same]:
            same += 1
        have = 0
        while have < same and self.pool.lookup(req.cache_scope, own[have]) is not None:
            have += 1
        return have, same - have, same

    def record_query(self, num_tokens: int, hit: PrefixHit) -> None:
        self.query_tokens += num_tokens
        self.hit_tokens += hit.num_tokens
        for t in hit.loaded:
            t.tier.hit_tokens += self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        """Reserve blocks for `num_new_tokens` more tokens (after `hit`'s). False, and nothing changes,
        when the pool cannot fit them."""
        need = self._blocks_needed(req, num_new_tokens, hit)
        shared = self._shared_partial_block(req) if num_new_tokens > 0 else None
        if need + (shared is not None) > self._blocks_available(hit):
            return False
        held = self._blocks.setdefault(req.request_id, [])
        if shared is not None:  # copy on write: this sequence is about to write into a shared block
            (copy,) = self.pool.allocate(1)
            self.pending_copies.append((held[shared].block_id, copy.block_id))
            self.pool.free([held[shared]])
            held[shared] = copy
        if not held:
            self._indexes[req.request_id] = self.pool.open_index(req.cache_scope)
            self._num_indexed[req.request_id] = len(hit.blocks) + len(hit.loaded)
        if hit.blocks:
            self.pool.touch(list(hit.blocks))
            held.extend(hit.blocks)
        if need > 0:
            new = self.pool.allocate(need)
            self._load(req, len(held), new, hit.loaded)
            held.extend(new)
        req.remote_kv = None  # admitted: what it pulled is landed (or was not needed)
        return True

    def _load(self, req: Request, first: int, blocks: list[KVBlock], loaded: tuple[TierHit, ...]) -> None:
        """The first of the request's new blocks take the blocks found in the tiers: they leave their
        tier and are indexed in the pool at once (their data is written before this step's forward
        pass, like a block computed in it)."""
        events = self.pool.events
        index = self._indexes[req.request_id]
        for i, (block, t) in enumerate(zip(blocks, loaded), start=first):
            if isinstance(t.tier, RemoteSource):
                t.tier.landed_blocks += 1
                if self.offload is not None:
                    self.offload.discard(t.key)  # no tier keeps a second copy
            else:  # blocks come back from the tiers only when there are tiers (self.offload is set)
                self.offload.take(t.tier, t.key)  # type: ignore[union-attr]
            self.pool.cache_block(block, index, t.key)
            self._transfers.loads.append((block.block_id, t.block))
            if events is not None:
                events.block_stored(
                    req.block_hashes, i, req.all_token_ids, req.lora.name if req.lora else None
                )

    def cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Index the request's blocks that are full once its first `num_tokens` tokens are computed.

        The scheduler calls this when it schedules the step that computes them, not after: inside one
        forward pass every layer writes all new K/V before any attention reads it, so a request admitted
        later in the same step may already share these blocks instead of computing them again.
        Nothing is indexed if a reset of its scope (or of all) happened since the request's KV began: KV
        computed across a reset must never be found after it.
        """
        if not self.enable_prefix_caching:
            return
        held = self._blocks.get(req.request_id)
        index = self._indexes.get(req.request_id)
        if not held or index is None or not self.pool.is_live(index):
            return
        num_full = num_tokens // self.block_size
        start = self._num_indexed[req.request_id]
        if num_full <= start:
            return
        req.update_block_hashes(self.block_size)
        events = self.pool.events
        for i in range(start, num_full):
            if not self.pool.cache_block(held[i], index, req.block_hashes[i]):
                continue
            if events is not None:
                events.block_stored(
                    req.block_hashes, i, req.all_token_ids, req.lora.name if req.lora else None
                )
            if self.offload is not None:
                self.offload.discard(req.block_hashes[i])  # computed again: no tier keeps a second copy
        self._num_indexed[req.request_id] = num_full

    def began_in_live_index(self, req: Request) -> bool:
        """No reset of the request's scope (or of all) since its KV began: what it computed may be kept."""
        index = self._indexes.get(req.request_id)
        return index is not None and self.pool.is_live(index)

    def fork(self, parent: Request, child: Request) -> None:
        """`child` continues from `parent`'s tokens: it shares all of parent's blocks (a reference
        each); the last one, if partly filled, is copied when either of them first writes to it."""
        blocks = self._blocks[parent.request_id]
        self.pool.touch(blocks, hit=False)
        self._blocks[child.request_id] = list(blocks)
        self._num_indexed[child.request_id] = self._num_indexed[parent.request_id]
        index = self._indexes[child.request_id] = self._indexes[parent.request_id]
        index.holders += 1

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def take_transfers(self) -> KVTransfers:
        out, self._transfers = self._transfers, KVTransfers([], [])
        return out

    def store_offloaded(
        self, saves: list[tuple[int, BlockHash, CacheScope]], blocks: list[HostBlock]
    ) -> None:
        """The evicted blocks' data, read off the pool: into the tiers, unless the pool has indexed the
        same key again meanwhile (a request of the same step computed it)."""
        for (_, key, scope), block in zip(saves, blocks):
            if self.pool.lookup(scope, key) is None:
                block.scope = scope
                # saves are only collected when there are tiers (on_evict is set with self.offload)
                self.offload.store(key, block)  # type: ignore[union-attr]

    def free(self, req: Request) -> None:
        if self.offload is not None:
            self.offload.forget(req.request_id)
        blocks = self._blocks.pop(req.request_id, None)
        self._num_indexed.pop(req.request_id, None)
        if blocks:
            self.pool.free(blocks)
        index = self._indexes.pop(req.request_id, None)
        if index is not None:
            self.pool.close_index(index)

    def pin_prompt(self, req: Request) -> PinResult:
        """Pin the blocks the prefix index holds for the request's prompt, full blocks from its start (a
        block past a gap could never be hit): the ones a later request finds, which need not be those
        this request computed (its last block, recomputed for its last token, is a copy never indexed)."""
        if not self.pool.pin_cap:
            return PinResult(False, reason="disabled")
        req.update_block_hashes(self.block_size)
        cached = []
        for key in req.block_hashes[: req.num_prompt_tokens // self.block_size]:
            block = self.pool.lookup(req.cache_scope, key)
            if block is None:
                break
            cached.append(block)
        if not cached:
            return PinResult(False, reason="not_cached")
        return self.pool.pin(cached)

    def block_ids(self, req: Request) -> list[int]:
        return [b.block_id for b in self._blocks.get(req.request_id, ())]

    def reset_prefix_cache(self, match: Callable[[CacheScope], bool] | None = None) -> dict[str, int]:
        """Every tier at once; the blocks each made unreachable, by tier ("pool", "host", "disk"). With
        `match`, only the blocks of the scopes it names, in every tier."""
        self.generation += 1
        if match is None:
            evicted = {"pool": self.pool.reset()}
            if self.offload is not None:
                evicted |= self.offload.reset()
            return evicted
        evicted = {"pool": self.pool.reset_scopes(match)}
        if self.offload is not None:
            evicted |= self.offload.reset_scopes(match)
        return evicted

    def _shared_partial_block(self, req: Request) -> int | None:
        """Index of the partly filled block the next token goes to, when another sequence holds it too."""
        if req.num_computed_tokens % self.block_size == 0:
            return None  # the next token starts a new block
        held = self._blocks.get(req.request_id, ())
        i = req.num_computed_tokens // self.block_size
        return i if i < len(held) and held[i].ref_cnt > 1 else None

    def _blocks_needed(self, req: Request, num_new_tokens: int, hit: PrefixHit) -> int:
        held = len(self._blocks.get(req.request_id, ()))
        total_tokens = req.num_computed_tokens + hit.num_tokens + num_new_tokens
        return max(0, -(-total_tokens // self.block_size) - held - len(hit.blocks))

    def _blocks_available(self, hit: PrefixHit) -> int:
        # Hit blocks that sit in the free queue stop being allocatable once we take them.
        return self.pool.num_free_blocks - sum(1 for b in hit.blocks if b.ref_cnt == 0)
