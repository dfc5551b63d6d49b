"""Logprobs (prompt and output) against transformers, and n > 1 sequences sharing the prompt's blocks."""

from __future__ import annotations

import pytest
import torch

from kvpilot.daemon.engine.request import SamplingParams
from support.engine import request_of

# 37 tokens: the prompt ends inside a block (block size 16), so forks share a partly filled block.
PROMPT = list(range(700, 737))


@pytest.fixture(scope="module")
def engine(make_engine):  # noqa: ANN001, ANN201
    return make_engine(num_kv_blocks=64)


@pytest.fixture(scope="module")
def hf_logprobs(hf_model) -> torch.Tensor:  # noqa: ANN001
    with torch.inference_mode():
        logits = hf_model(torch.tensor([PROMPT])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def run(engine, rid: str, params: SamplingParams) -> dict[int, list]:  # noqa: ANN001
    """All outputs of one request, by sequence index."""
    engine.add_request(rid, PROMPT, params)
    outs: dict[int, list] = {}
    while request_of(engine, rid) is not None:
        for o in engine.step():
            if o.request_id == rid:
                outs.setdefault(o.index, []).append(o)
    return outs


def test_prompt_logprobs_match_transformers_cached_or_not(engine, hf_logprobs) -> None:  # noqa: ANN001
    want = hf_logprobs[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None]).squeeze(1)
    for attempt in range(2):  # the second run finds the prompt's blocks cached and recomputes them
        (outs,) = run(engine, f"score-{attempt}", SamplingParams(max_tokens=0, prompt_logprobs=2)).values()
        assert len(outs) == 1 and outs[0].finished and outs[0].new_token_ids == []
        assert outs[0].finish_reason == "length"
        prompt = outs[0].prompt_logprobs
        assert prompt[0] is None and [lp.token_id for lp in prompt[1:]] == PROMPT[1:]
        got = torch.tensor([lp.logprob for lp in prompt[1:]])
        assert (got - want).abs().max().item() < 1e-3
        top = prompt[5].top
        assert len(top) == 2 and top[0][0] == int(hf_logprobs[4].argmax())


def test_output_logprobs_of_greedy_tokens_are_the_top_ones(engine) -> None:  # noqa: ANN001
    (outs,) = run(engine, "lp", SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True)).values()
    lps = [lp for o in outs for lp in o.logprobs]
    assert [lp.token_id for lp in lps] == [t for o in outs for t in o.new_token_ids]
    for lp in lps:
        assert len(lp.top) == 3 and lp.top[0] == (lp.token_id, lp.logprob)
    assert outs[-1].cumulative_logprob == pytest.approx(sum(lp.logprob for lp in lps), abs=1e-4)


def test_greedy_forks_share_blocks_and_equal_a_single_sequence(engine) -> None:  # noqa: ANN001
    single = engine.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    engine.reset_prefix_cache()
    used_before = engine.stats().blocks_used
    engine.add_request("fork", PROMPT, SamplingParams(max_tokens=6, n=3, ignore_eos=True))
    outs: dict[int, list[int]] = {0: [], 1: [], 2: []}
    peak = 0
    while request_of(engine, "fork") is not None:
        for o in engine.step():
            outs[o.index].extend(o.new_token_ids)
        peak = max(peak, engine.stats().blocks_used - used_before)
    assert outs == {0: single, 1: single, 2: single}  # the copied partial block holds the same KV
    # 37 + 6 tokens = 3 blocks per sequence: 2 full prompt blocks shared, one own block each.
    assert peak == 2 + 3


def test_seeded_choices_differ_and_reproduce(engine) -> None:  # noqa: ANN001
    hot = SamplingParams(max_tokens=8, temperature=1.5, n=3, seed=11, ignore_eos=True)

    def choices(rid: str) -> list[list[int]]:
        return [
            [t for o in outs for t in o.new_token_ids] for _, outs in sorted(run(engine, rid, hot).items())
        ]

    first, again = choices("seeded-a"), choices("seeded-b")
    assert first == again
    assert len({tuple(c) for c in first}) == 3


def test_abort_before_the_fork_frees_everything(engine) -> None:  # noqa: ANN001
    free = engine.stats().blocks_free + engine.stats().blocks_cached
    engine.add_request("gone", PROMPT, SamplingParams(max_tokens=5, n=4))
    assert engine.abort_request("gone")
    assert not engine.has_unfinished_requests()
    assert engine.stats().blocks_free + engine.stats().blocks_cached == free


def test_min_tokens_and_repetition_penalty(engine) -> None:  # noqa: ANN001
    greedy = engine.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    stop = greedy[0]
    assert engine.generate([PROMPT], SamplingParams(max_tokens=6, stop_token_ids=frozenset({stop})))[0] == [
        stop
    ]
    held = engine.generate(
        [PROMPT], SamplingParams(max_tokens=6, min_tokens=3, stop_token_ids=frozenset({stop}))
    )[0]
    assert len(held) >= 3 and stop not in held[:3]
    penalized = engine.generate(
        [PROMPT], SamplingParams(max_tokens=6, repetition_penalty=5.0, ignore_eos=True)
    )[0]
    assert len(set(penalized)) == len(penalized)  # a strong penalty never repeats a token
    assert not set(penalized) & set(PROMPT)
