"""Property test: random add / abort / step / reset / unpin sequences never leak or double-free a block,
with n > 1 requests forking (shared blocks, copy on write) and requests pinning their prompts among them,
under each eviction policy.

Runs on a tiny random-weight Llama (real loading path, real model runner) with a pool small enough
that preemption happens often.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.request import SamplingParams
from kvpilot.kv.reset_scope import ResetScope

SHARED_PREFIXES = [[], list(range(1000, 1012)), list(range(2000, 2020))]

add_op = st.tuples(
    st.just("add"),
    st.integers(1, 28),  # own tokens after the shared prefix
    st.integers(1, 10),  # max_tokens
    st.integers(0, len(SHARED_PREFIXES) - 1),
    st.sampled_from([None, "tenant"]),
    st.integers(1, 3),  # sequences sharing the prompt (n)
    st.booleans(),  # pin_prefix
)
ops = st.lists(
    st.one_of(
        add_op,
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(1, 3)),
        st.tuples(st.just("reset"), st.booleans()),
        st.tuples(st.just("unpin"), st.sampled_from([None, "tenant"])),
    ),
    min_size=1,
    max_size=40,
)


@pytest.fixture(scope="module", params=["lru", "lfu"])
def engine(request, tiny_model_dir) -> LLMEngine:  # noqa: ANN001
    return LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir),
            block_size=4,
            num_kv_blocks=24,
            max_num_batched_tokens=32,
            max_num_seqs=6,
            enable_pinned_prefix=True,
            pinned_prefix_cap_ratio=0.25,  # 6 of 24: pins fill it and are refused
            prefix_cache_eviction_policy=request.param,
        )
    )


def check_invariants(eng: LLMEngine) -> None:
    pool = eng.kv.pool
    s = eng.stats()
    assert s.blocks_free + s.blocks_cached + s.blocks_used == s.blocks_total
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    holders = Counter(b.block_id for blocks in eng.kv._blocks.values() for b in blocks)
    assert all(b.ref_cnt == holders.get(b.block_id, 0) + b.pinned for b in pool.blocks)
    assert s.pinned_blocks == sum(b.pinned for b in pool.blocks) <= pool.pin_cap
    assert all(pool.is_cached(b) for b in pool.blocks if b.pinned)  # a pin is never of a dead block
    assert s.blocks_used == sum(1 for b in pool.blocks if b.ref_cnt > 0)
    assert s.blocks_cached == sum(1 for b in pool.blocks if b.ref_cnt == 0 and pool.is_cached(b))
    assert sorted(pool._free.block_ids()) == sorted(b.block_id for b in pool.blocks if b.ref_cnt == 0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_random_operations_keep_the_pool_consistent(engine: LLMEngine, ops: list) -> None:
    added: list[str] = []
    finished: set[str] = set()
    for op in ops:
        if op[0] == "add":
            _, n, max_tokens, prefix, salt, seqs, pin = op
            rid = f"q{len(added)}-{id(ops)}"
            prompt = SHARED_PREFIXES[prefix] + [3000 + (7 * len(added) + i) % 500 for i in range(n)]
            params = SamplingParams(max_tokens=max_tokens, n=seqs)
            engine.add_request(rid, prompt, params, cache_salt=salt, pin_prefix=pin)
            added.append(rid)
        elif op[0] == "abort" and added:
            rid = added[op[1] % len(added)]
            if engine.abort_request(rid):
                finished.add(rid)
        elif op[0] == "step":
            for _ in range(op[1]):
                finished.update(o.request_id for o in engine.step() if o.finished)
        elif op[0] == "reset":
            before = engine.stats().epoch
            pinned = engine.stats().pinned_blocks
            r = engine.reset_prefix_cache(reset_running_requests=op[1])
            assert r.success and r.epoch == before + 1 and engine.stats().blocks_cached == 0
            assert r.unpinned_blocks == pinned and engine.stats().pinned_blocks == 0  # cold means cold
        elif op[0] == "unpin":
            scope = None if op[1] is None else ResetScope(cache_salt=op[1])
            pinned = engine.stats().pinned_blocks
            left = sum(b.pinned and b.index.scope.cache_salt != op[1] for b in engine.kv.pool.blocks)
            assert engine.unpin_prefixes(scope) == pinned - (0 if scope is None else left)
        check_invariants(engine)

    for _ in range(500):  # everything finishes: nothing is dropped or stuck
        if not engine.has_unfinished_requests():
            break
        finished.update(o.request_id for o in engine.step() if o.finished)
        check_invariants(engine)
    assert not engine.has_unfinished_requests()
    assert finished == set(added)
    assert engine.stats().blocks_used == engine.stats().pinned_blocks
