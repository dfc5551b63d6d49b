"""Prefix-cache reset on the real model: nothing cached before it is found after it, and no running
request is harmed by it."""

from __future__ import annotations

import pytest

from kvpilot.daemon.engine.request import SamplingParams
from support.engine import run_alone

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def quiet_outputs(make_engine, shared_prefix_prompts) -> list[list[int]]:  # noqa: ANN001
    return make_engine(enable_prefix_caching=False).generate(shared_prefix_prompts[:4], PARAMS)


def run_one(engine, rid: str, prompt: list[int]) -> tuple[list[int], int]:  # noqa: ANN001
    return run_alone(engine, rid, prompt, SamplingParams(max_tokens=4))


def test_zero_hits_right_after_reset(engine, shared_prefix_prompts) -> None:  # noqa: ANN001
    prompt = shared_prefix_prompts[0]
    first, cached_cold = run_one(engine, "a", prompt)
    again, cached_warm = run_one(engine, "b", prompt)
    assert cached_warm >= len(prompt) - 16 > 0
    assert engine.stats().blocks_cached > 0

    epoch = engine.stats().epoch
    result = engine.reset_prefix_cache()
    assert result.success and result.epoch == epoch + 1
    assert result.evicted_blocks > 0 and result.in_flight_requests == 0 and result.preempted_requests == 0
    stats = engine.stats()
    assert stats.blocks_cached == 0 and stats.blocks_used == 0 and stats.epoch == epoch + 1

    after, cached_after = run_one(engine, "c", prompt)
    assert cached_after == 0
    assert first == again == after


def test_reset_mid_run_changes_no_tokens(make_engine, shared_prefix_prompts, quiet_outputs) -> None:  # noqa: ANN001
    eng = make_engine()
    outputs: dict[str, list[int]] = {}
    for i, p in enumerate(shared_prefix_prompts[:4]):
        eng.add_request(f"r{i}", p, PARAMS)
        outputs[f"r{i}"] = []
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            outputs[o.request_id] += o.new_token_ids
        steps += 1
        if steps == 3:
            result = eng.reset_prefix_cache()
            assert result.success and result.in_flight_requests == 4 and result.preempted_requests == 0
    assert [outputs[f"r{i}"] for i in range(4)] == quiet_outputs
    # Their blocks were held across the reset: they are freed, never re-indexed.
    stats = eng.stats()
    assert stats.blocks_cached == 0 and stats.blocks_used == 0


def test_reset_running_requests_preempts_and_recomputes(
    make_engine, shared_prefix_prompts, quiet_outputs
) -> None:  # noqa: ANN001
    eng = make_engine()
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    for i, p in enumerate(shared_prefix_prompts[:4]):
        eng.add_request(f"r{i}", p, PARAMS)
    steps, preempted = 0, None
    while eng.has_unfinished_requests():
        for o in eng.step():
            outputs[o.request_id] += o.new_token_ids
        steps += 1
        if steps == 4:
            running = eng.stats().num_running
            result = eng.reset_prefix_cache(reset_running_requests=True)
            preempted = result.preempted_requests
            assert running > 0 and preempted == running
            # Nothing is held any more: all KV computed before the reset is gone with them.
            assert eng.stats().blocks_used == 0
    assert preempted is not None
    assert [outputs[f"r{i}"] for i in range(4)] == quiet_outputs
