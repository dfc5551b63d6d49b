"""Greedy tokens of the engine equal transformers', and stay the same however the engine runs them."""

from __future__ import annotations

import pytest

from kvpilot.daemon.engine.request import SamplingParams

MAX_TOKENS = 32
# ignore_eos keeps every request decoding to the end, so the pool really fills and preemption happens.
SHARED = SamplingParams(max_tokens=20, ignore_eos=True)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:  # noqa: ANN001
    """transformers' greedy continuation of `prompt`, the reference the engine must match."""
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def shared_baseline(make_engine, shared_prefix_prompts) -> list[list[int]]:  # noqa: ANN001
    """Outputs with prefix caching off and one request at a time: the plainest way to run."""
    eng = make_engine(enable_prefix_caching=False, max_num_seqs=1)
    return eng.generate(shared_prefix_prompts, SHARED)


def test_greedy_matches_transformers(engine, hf_model, chat_prompts) -> None:  # noqa: ANN001
    ours = engine.generate(chat_prompts, SamplingParams(max_tokens=MAX_TOKENS))
    for prompt, got in zip(chat_prompts, ours):
        assert got == hf_greedy(hf_model, prompt, MAX_TOKENS)
    assert engine.stats().blocks_used == 0


def test_prefix_cached_batch_matches_baseline(make_engine, shared_prefix_prompts, shared_baseline) -> None:  # noqa: ANN001
    eng = make_engine()
    params = SHARED
    cold = eng.generate(shared_prefix_prompts, params)
    hits_after_cold = eng.stats().hit_tokens
    # Even cold, requests admitted beside the first share the system prompt it computes in that step.
    assert hits_after_cold >= (len(shared_prefix_prompts) - 1) * 64
    warm = eng.generate(shared_prefix_prompts, params)
    assert cold == shared_baseline
    assert warm == shared_baseline
    # The warm pass must actually have read the cache: nearly every prompt token of every prompt.
    warm_hits = eng.stats().hit_tokens - hits_after_cold
    assert warm_hits >= sum(len(p) - 16 for p in shared_prefix_prompts)


def test_small_chunked_prefill_matches_baseline(make_engine, shared_prefix_prompts, shared_baseline) -> None:  # noqa: ANN001
    eng = make_engine(max_num_batched_tokens=24)
    assert eng.generate(shared_prefix_prompts, SHARED) == shared_baseline


def test_preemption_under_a_tiny_pool_matches_baseline(
    make_engine, shared_prefix_prompts, shared_baseline
) -> None:  # noqa: ANN001
    prompt_blocks = max(-(-len(p) // 16) for p in shared_prefix_prompts)
    # Room for two prompts and one spare block: two requests are admitted, and as they decode into
    # new blocks the newest must be preempted.
    eng = make_engine(num_kv_blocks=2 * prompt_blocks + 1, enable_prefix_caching=False)
    out = eng.generate(shared_prefix_prompts, SHARED)
    assert eng.stats().num_preemptions > 0
    assert out == shared_baseline
    assert eng.stats().blocks_used == 0


def test_staggered_arrivals_match_baseline(make_engine, shared_prefix_prompts, shared_baseline) -> None:  # noqa: ANN001
    """Requests join a batch that is already decoding (continuous batching)."""
    eng = make_engine(max_num_batched_tokens=64)
    outputs: dict[str, list[int]] = {}
    pending = list(enumerate(shared_prefix_prompts))
    while pending or eng.has_unfinished_requests():
        if pending:
            i, prompt = pending.pop(0)
            eng.add_request(f"r{i}", prompt, SHARED)
            outputs[f"r{i}"] = []
        for o in eng.step():
            outputs[o.request_id].extend(o.new_token_ids)
    assert [outputs[f"r{i}"] for i in range(len(shared_prefix_prompts))] == shared_baseline
