"""`cache_salt` isolates tenants: different salts never share a block, equal salts do."""

from __future__ import annotations

from kvpilot.daemon.engine.request import SamplingParams
from support.engine import request_of


def test_different_salts_never_share_blocks(make_engine, shared_prefix_prompts) -> None:  # noqa: ANN001
    eng = make_engine()
    prompt = shared_prefix_prompts[1]
    params = SamplingParams(max_tokens=2)

    eng.generate([prompt], params, cache_salt="tenant-a")
    # Same tokens, another tenant: it must not find tenant-a's blocks.
    eng.add_request("b", prompt, params, cache_salt="tenant-b")
    eng.add_request("none", prompt, params)
    eng.step()
    held_b = set(eng.kv.block_ids(request_of(eng, "b")))
    held_none = set(eng.kv.block_ids(request_of(eng, "none")))
    assert request_of(eng, "b").num_cached_tokens == 0
    assert request_of(eng, "none").num_cached_tokens == 0
    assert held_b.isdisjoint(held_none)
    while eng.has_unfinished_requests():
        eng.step()

    # The same tenant again finds its own prefix.
    eng.add_request("a2", prompt, params, cache_salt="tenant-a")
    eng.step()
    assert request_of(eng, "a2").num_cached_tokens >= len(prompt) - 16
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.stats().blocks_used == 0
