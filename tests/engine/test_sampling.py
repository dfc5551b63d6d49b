"""Sampling: seeds reproduce, top-k 1 is greedy, stop ids and max_tokens end requests."""

from __future__ import annotations

import pytest

from kvpilot.daemon.engine.request import SamplingError, SamplingParams
from support.engine import request_of


@pytest.fixture(scope="module")
def engine(tiny_model_dir):  # noqa: ANN001, ANN201
    from kvpilot.daemon.engine.config import EngineConfig
    from kvpilot.daemon.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))


PROMPT = list(range(500, 530))


def test_seeded_sampling_reproduces_alone_and_in_a_batch(engine) -> None:  # noqa: ANN001
    hot = SamplingParams(max_tokens=12, temperature=1.5, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    alone = engine.generate([PROMPT], hot)[0]
    others = SamplingParams(max_tokens=12, temperature=1.0, seed=None, ignore_eos=True)
    engine.add_request("noise", list(range(600, 640)), others)
    batched = engine.generate([PROMPT], hot)[0]
    while engine.has_unfinished_requests():
        engine.step()
    assert alone == batched
    other_seed = engine.generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=1.5, seed=8, ignore_eos=True)
    )[0]
    assert other_seed != alone


def test_top_k_one_is_greedy(engine) -> None:  # noqa: ANN001
    greedy = engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    topk1 = engine.generate(
        [PROMPT], SamplingParams(max_tokens=8, temperature=2.0, top_k=1, ignore_eos=True)
    )[0]
    assert greedy == topk1


def test_stop_token_and_max_tokens(engine) -> None:  # noqa: ANN001
    greedy = engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(greedy) == 8
    stop_at = greedy[3]
    first = greedy.index(stop_at)
    stopped = engine.generate(
        [PROMPT], SamplingParams(max_tokens=8, stop_token_ids=(stop_at,), ignore_eos=True)
    )[0]
    assert stopped == greedy[: first + 1]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=0),
        SamplingParams(temperature=-1),
        SamplingParams(top_p=0),
        SamplingParams(top_k=-2),
    ],
)
def test_bad_parameters_are_refused(engine, params: SamplingParams) -> None:  # noqa: ANN001
    with pytest.raises(SamplingError):
        engine.add_request("bad", PROMPT, params)
    assert request_of(engine, "bad") is None


def test_prompts_that_cannot_fit_are_refused(engine) -> None:  # noqa: ANN001
    from kvpilot.daemon.engine.admission import RequestRejected

    with pytest.raises(RequestRejected):
        engine.add_request("long", [5] * engine.max_model_len, SamplingParams())
    with pytest.raises(RequestRejected):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(RequestRejected):
        engine.add_request("vocab", [10**9], SamplingParams())


def test_tiny_temperature_is_greedy_and_odd_salts_hash(engine) -> None:  # noqa: ANN001
    greedy = engine.generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    tiny = engine.generate([PROMPT], SamplingParams(max_tokens=4, temperature=1e-300, ignore_eos=True))[0]
    assert tiny == greedy
    # A lone surrogate is a valid Python str: it must hash, not crash the step.
    assert len(engine.generate([PROMPT], SamplingParams(max_tokens=2), cache_salt="\udfff")[0]) == 2


def test_rejections_name_the_parameter(engine) -> None:  # noqa: ANN001
    from kvpilot.daemon.engine.admission import RequestRejected

    with pytest.raises(RequestRejected) as err:
        engine.add_request("float", [1.5, 2], SamplingParams())
    assert err.value.param == "prompt"
    with pytest.raises(RequestRejected) as err:
        engine.add_request("salt", PROMPT, SamplingParams(), cache_salt=b"bytes")
    assert err.value.param == "cache_salt"


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    import torch

    from kvpilot.daemon.engine.request import Request
    from kvpilot.daemon.engine.sampler import Sampler

    logits = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    req = Request("p", [1], SamplingParams(temperature=1.0, top_p=0.5, seed=3))
    sampler = Sampler()
    assert {sampler.sample(logits[None], [req])[0][0] for _ in range(50)} == {0}
    nan_row = torch.tensor([[float("nan"), 1.0, 2.0]])
    assert sampler.sample(nan_row, [req])[0] == [2]  # degrades to greedy instead of raising


def test_seed_out_of_range_is_refused(engine) -> None:  # noqa: ANN001
    with pytest.raises(SamplingError):
        engine.add_request("seed", PROMPT, SamplingParams(seed=2**64))


def test_draws_follow_the_distribution_batched_and_seeded() -> None:
    import torch

    from kvpilot.daemon.engine.request import Request
    from kvpilot.daemon.engine.sampler import Sampler

    want = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = torch.log(want).expand(2000, 4).clone()
    reqs = [
        Request(f"d{i}", [1], SamplingParams(temperature=1.0, seed=i if i % 2 else None)) for i in range(2000)
    ]
    tokens, _ = Sampler().sample(logits, reqs)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / len(tokens)
    assert freq[3] == 0  # a zero-probability token is never drawn
    assert (freq - want).abs().max() < 0.05, freq
