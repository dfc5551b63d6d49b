"""Pure logic of the block pool, the prefix keys and the KV cache manager (no model)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpilot.daemon.engine.kv.block_pool import BlockPool
from kvpilot.daemon.engine.kv.cache_manager import KVCacheManager
from kvpilot.daemon.engine.kv.cache_scope import CacheScope
from kvpilot.daemon.engine.request import Request, SamplingParams
from kvpilot.kv.block_keys import DEFAULT_KEYS, HASH_ALGOS, KeyScheme

hash_block = DEFAULT_KEYS.hash_block
BASE = CacheScope(None, None, None)  # the base model's unsalted blocks


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_keys_chain_the_prefix_and_the_salt(algo: str) -> None:
    keys = KeyScheme(algo)
    a = keys.prompt_hashes(list(range(32)), 16)
    b = keys.prompt_hashes([99] + list(range(1, 32)), 16)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same 2nd block tokens, other parent
    salted = keys.prompt_hashes(list(range(32)), 16, "tenant")
    versioned = keys.prompt_hashes(list(range(32)), 16, None, "tenant")
    assert len({*a, *salted, *versioned}) == 6  # a salt and a version of the same text never share a key
    # a lone surrogate (JSON allows "\ud800") hashes, and apart from the text it resembles
    assert (
        keys.prompt_hashes(list(range(16)), 16, "\ud800")[0]
        != keys.prompt_hashes(list(range(16)), 16, "?")[0]
    )


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_keys_are_the_same_in_another_process_and_seeded_as_vllm_seeds(algo: str) -> None:
    code = (
        "from kvpilot.kv.block_keys import key_scheme; "
        f"print(key_scheme({algo!r}).prompt_hashes([1, 2, 3, 4], 4, 's')[0].hex())"
    )

    def run(**env: str) -> str:
        clean = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=clean | env
        ).stdout.strip()

    here = KeyScheme(algo).prompt_hashes([1, 2, 3, 4], 4, "s")[0].hex()
    assert run() == here
    seeded = run(PYTHONHASHSEED="7")
    assert (seeded == here) == (algo == "kvpilot")  # vLLM's schemes take PYTHONHASHSEED as their seed
    assert seeded == KeyScheme(algo, "7").prompt_hashes([1, 2, 3, 4], 4, "s")[0].hex()


def test_lru_eviction_and_unhashed_blocks_first() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, blk in enumerate(blocks[:2]):
        pool.cache_block(blk, pool.open_index(BASE), hash_block(None, [i], None))
    pool.free(blocks)  # two cached, two plain
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    # Plain blocks are reused first; then the least recently freed cached one (freed in reverse, so
    # the tail of the sequence, blocks[1], goes before its head).
    got = pool.allocate(3)
    assert {b.block_id for b in got[:2]} == {blocks[2].block_id, blocks[3].block_id}
    assert got[2] is blocks[1]
    assert pool.lookup(BASE, hash_block(None, [1], None)) is None
    assert pool.lookup(BASE, hash_block(None, [0], None)) is blocks[0]


def test_reset_makes_everything_unreachable_and_never_reindexes_held_blocks() -> None:
    pool = BlockPool(8)
    held = pool.allocate(3)
    for i, blk in enumerate(held):
        pool.cache_block(blk, pool.open_index(BASE), hash_block(None, [i], None))
    pool.free(held[:1])
    assert pool.num_cached_blocks == 1
    assert pool.reset() == 3
    assert pool.epoch == 1 and pool.num_cached_blocks == 0
    assert all(pool.lookup(BASE, hash_block(None, [i], None)) is None for i in range(3))
    pool.free(held[1:])
    assert pool.num_cached_blocks == 0 and pool.num_free_blocks == 8


def test_manager_refuses_what_does_not_fit_and_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    req = Request("r", list(range(20)), SamplingParams())
    assert not kv.allocate_slots(req, 20)
    assert kv.pool.num_free_blocks == 4 and kv.block_ids(req) == []
    assert kv.allocate_slots(req, 16)
    assert len(kv.block_ids(req)) == 4
    kv.free(req)
    assert kv.pool.num_free_blocks == 4


def test_prefix_hit_leaves_the_last_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = Request("a", list(range(8)), SamplingParams())
    assert kv.allocate_slots(first, 8)
    kv.cache_full_blocks(first, 8)
    kv.free(first)
    again = Request("b", list(range(8)), SamplingParams())
    hit = kv.find_prefix(again)
    assert hit.num_tokens == 4  # not 8: the model must run on the last token to sample


@pytest.mark.parametrize("num_blocks", [100_000])
def test_reset_cost_does_not_walk_the_pool(num_blocks: int) -> None:
    """O(1) reset: the pool's blocks are untouched by it (their stale keys are dropped lazily)."""
    pool = BlockPool(num_blocks)
    blocks = pool.allocate(num_blocks)
    for i, blk in enumerate(blocks):
        pool.cache_block(blk, pool.open_index(BASE), hash_block(None, [i], None))
    pool.free(blocks)
    assert pool.reset() == num_blocks
    assert sum(1 for b in pool.blocks if b.block_hash is not None) == num_blocks  # nothing walked
    assert pool.num_cached_blocks == 0 and pool.num_free_blocks == num_blocks
    # Reuse drops the stale key and never resurrects it.
    got = pool.allocate(1)[0]
    assert got.block_hash is None


def test_an_overflowed_request_never_leaks_into_other_decode_rows() -> None:
    import torch

    from kvpilot.kernels import AttentionMetadata
    from kvpilot.kernels.reference import paged_attention, write_kv

    torch.manual_seed(0)
    k_cache = torch.zeros(4, 4, 1, 8)
    v_cache = torch.zeros(4, 4, 1, 8)
    # Two live rows: 2 tokens in block 1, 7 tokens in blocks 2-3 (the last block's tail is padding).
    live = torch.tensor([4, 5, 8, 9, 10, 11, 12, 13, 14])
    write_kv(torch.randn(9, 1, 8), torch.randn(9, 1, 8), k_cache, v_cache, live)
    meta = AttentionMetadata.build([1, 1], [2, 7], [[1], [2, 3]], torch.device("cpu"))
    q = torch.randn(2, 2, 8)
    clean = paged_attention(q, k_cache, v_cache, meta, 0.3)
    # An earlier request overflowed into the padding slots both rows read: block 0 (table padding),
    # block 1's tail and block 3's tail.
    dead = torch.tensor([0, 1, 2, 3, 6, 7, 15])
    bad = torch.full((7, 1, 8), float("nan"))
    write_kv(bad, torch.full((7, 1, 8), float("inf")), k_cache, v_cache, dead)
    dirty = paged_attention(q, k_cache, v_cache, meta, 0.3)
    assert torch.isfinite(dirty).all() and torch.allclose(clean, dirty)


# ---- scoped resets: one adapter, salt or weight version --------------------------------------------
SALTED = CacheScope(None, None, "tenant-a")


def _cache(pool: BlockPool, scope: CacheScope, n: int, first: int = 0) -> list:
    blocks = pool.allocate(n)
    index = pool.open_index(scope)
    for i, blk in enumerate(blocks, start=first):
        pool.cache_block(blk, index, hash_block(None, [i], scope.cache_salt))
    return blocks


def test_a_scoped_reset_clears_its_scope_and_leaves_the_rest_warm() -> None:
    pool = BlockPool(16)
    base, salted = _cache(pool, BASE, 4), _cache(pool, SALTED, 3)
    pool.free(base)
    pool.free(salted[:2])  # one salted block stays held by its request
    assert pool.num_cached_blocks == 6
    assert pool.reset_scopes(lambda s: s.cache_salt == "tenant-a") == 3
    assert pool.epoch == 0 and pool.num_cached_blocks == 4  # a scoped reset is no full one
    assert all(pool.lookup(SALTED, hash_block(None, [i], "tenant-a")) is None for i in range(3))
    assert [pool.lookup(BASE, hash_block(None, [i], None)) for i in range(4)] == base
    pool.free(salted[2:])  # the held block comes back unreachable, not cached
    assert pool.num_cached_blocks == 4 and pool.num_free_blocks == 16
    assert pool.reset_scopes(lambda s: s.cache_salt == "tenant-a") == 0  # nothing left of it


def test_a_request_whose_scope_was_reset_never_indexes_its_kv() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = Request("r", list(range(8)), SamplingParams(), cache_salt="tenant-a")
    other = Request("o", list(range(8)), SamplingParams())
    for r in (req, other):
        assert kv.allocate_slots(r, 8)
    kv.reset_prefix_cache(lambda s: s.cache_salt == "tenant-a")
    for r in (req, other):
        kv.cache_full_blocks(r, 8)
        kv.free(r)
    assert (
        kv.find_prefix(Request("r2", list(range(8)), SamplingParams(), cache_salt="tenant-a")).num_tokens == 0
    )
    assert kv.find_prefix(Request("o2", list(range(8)), SamplingParams())).num_tokens == 4


def test_scopes_that_hold_nothing_are_dropped_whatever_salts_clients_send() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    for i in range(200):
        req = Request(f"r{i}", list(range(8)), SamplingParams(), cache_salt=f"salt-{i}")
        assert kv.allocate_slots(req, 8)
        kv.cache_full_blocks(req, 8)
        kv.free(req)
    assert len(kv.pool._scopes) <= 2  # the 4 blocks hold at most two salts' prefixes


@pytest.mark.parametrize("num_blocks", [100_000])
def test_a_scoped_reset_does_not_walk_the_pool(num_blocks: int) -> None:
    pool = BlockPool(num_blocks)
    pool.free(_cache(pool, SALTED, num_blocks // 2) + _cache(pool, BASE, num_blocks // 2, num_blocks))
    assert pool.reset_scopes(lambda s: s == SALTED) == num_blocks // 2
    assert sum(1 for b in pool.blocks if b.block_hash is not None) == num_blocks  # nothing walked
    assert pool.num_cached_blocks == num_blocks // 2


def test_pinned_blocks_are_never_evicted_until_unpinned_and_a_reset_drops_them() -> None:
    pool = BlockPool(8, pin_cap=3)
    pinned, other = _cache(pool, BASE, 2), _cache(pool, SALTED, 2)
    assert pool.pin(pinned).pinned and pool.num_pinned_blocks == 2
    assert pool.pin(pinned).blocks == 2 and pool.num_pinned_blocks == 2  # pinning again takes nothing more
    refused = pool.pin(other)  # 2 + 2 > 3: all or none
    assert (refused.pinned, refused.reason, pool.pins_refused) == (False, "cap", 1)
    pool.free(pinned + other)
    assert pool.num_free_blocks == 6  # the pins hold theirs
    pool.allocate(6)  # evicts every cached block but the pinned ones
    assert [pool.lookup(BASE, hash_block(None, [i], None)) for i in range(2)] == pinned
    assert pool.lookup(SALTED, hash_block(None, [0], "tenant-a")) is None
    assert pool.unpin(lambda s: s.cache_salt == "tenant-a") == 0  # a scope without pins
    assert pool.unpin() == 2 and pool.num_pinned_blocks == 0
    assert pool.num_cached_blocks == 2  # unpinned: still cached, evicted in turn
    again = _cache(BlockPool(4, pin_cap=4), BASE, 2)
    assert not BlockPool(4).pin(again).pinned  # pinning off: pin_cap 0

    reset = BlockPool(4, pin_cap=4)
    blocks = _cache(reset, BASE, 2)
    reset.pin(blocks)
    reset.free(blocks)
    assert reset.reset() == 2 and reset.unpin() == 2
    assert reset.num_free_blocks == 4 and reset.num_cached_blocks == 0  # cold means cold


def test_lfu_evicts_the_least_hit_block_first_and_dead_blocks_before_live_ones() -> None:
    pool = BlockPool(4, eviction_policy="lfu")
    hot, cold = _cache(pool, BASE, 1), _cache(pool, BASE, 1, first=1)
    pool.free(hot + cold)
    for _ in range(3):  # the hot block is hit three times (freed after each request)
        pool.touch(hot)
        pool.free(hot)
    got = pool.allocate(3)  # the two plain blocks, then the least hit cached one
    assert cold[0] in got and hot[0] not in got
    pool.free(got)
    # LRU on the same story, the cold block freed last: it keeps the cold block and evicts the hot one
    lru = BlockPool(4)
    lhot, lcold = _cache(lru, BASE, 1), _cache(lru, BASE, 1, first=1)
    lru.free(lhot)
    lru.touch(lhot)
    lru.free(lhot)
    lru.free(lcold)
    assert lhot[0] in lru.allocate(3)

    # a reset makes every block dead: one hit often before is reused before any block cached after it
    pool.reset()
    fresh = _cache(pool, BASE, 1, first=7)
    pool.free(fresh)
    got = pool.allocate(3)
    assert fresh[0] not in got and hot[0] in got
