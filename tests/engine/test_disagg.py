"""Prefill/decode disaggregation inside the engine, on the real model: a producer holds a prefill's blocks off
the pool, a consumer plans a pull of only what its pool lacks and lands the blocks as a tier's, greedy tokens
as one engine computes them; a reset on either side, and an evicted prefix, leave nothing stale landed.
(The wire and the servers: tests/server/test_disagg.py.)"""

from __future__ import annotations

import json

import pytest

from kvpilot.daemon.engine.client import EngineRequest
from kvpilot.daemon.engine.request import SamplingParams
from kvpilot.daemon.kv_transfer.remote import RemoteBlocks
from support.engine import run_alone, run_request

BS = 16
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def connector(role: str) -> str:
    return json.dumps({"kv_connector": "KvpilotConnector", "kv_role": role})


@pytest.fixture(scope="module")
def producer(make_engine):  # noqa: ANN001, ANN201
    return make_engine(kv_transfer_config=connector("kv_producer"))


@pytest.fixture
def consumer(make_engine):  # noqa: ANN001, ANN201
    return make_engine(kv_transfer_config=connector("kv_consumer"), num_kv_blocks=48)


@pytest.fixture(scope="module")
def reference(make_engine, shared_prefix_prompts) -> list[list[int]]:  # noqa: ANN001
    eng = make_engine(enable_prefix_caching=False)
    return [run_alone(eng, f"ref{i}", p, PARAMS)[0] for i, p in enumerate(shared_prefix_prompts)]


def prefill(engine, hold_id: str, prompt: list[int]):  # noqa: ANN001, ANN201
    """Run a prefill for a remote decode to its end; its last output."""
    engine.submit(EngineRequest(hold_id, prompt, SamplingParams(max_tokens=1), kv_hold=hold_id))
    last = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            last = o
    return last


def pull_from(producer, consumer, hold_id: str, prompt: list[int], keys) -> RemoteBlocks | None:  # noqa: ANN001
    """What a decode pod's server does: plan against its own pool, take the hold (the pull), slice."""
    plan = consumer.plan_pull(EngineRequest("plan", prompt, PARAMS), list(keys))
    held = producer.connector.held.take(hold_id)
    if plan.count == 0 or held is None:
        return None
    data = held.data[plan.first : plan.first + plan.count]
    return RemoteBlocks(plan.first, tuple(keys[plan.first : plan.first + plan.count]), data, plan.generation)


def decode(consumer, rid: str, prompt: list[int], remote: RemoteBlocks | None) -> tuple[list[int], int]:  # noqa: ANN001
    return run_request(consumer, EngineRequest(rid, prompt, PARAMS, remote_kv=remote))


def test_a_decode_lands_the_prefill_blocks_and_answers_as_one_engine(
    producer, consumer, shared_prefix_prompts, reference
) -> None:  # noqa: ANN001
    prompt = shared_prefix_prompts[0]
    out = prefill(producer, "h0", prompt)
    n = (len(prompt) - 1) // BS
    assert out.finished and out.held is not None and len(out.held.keys) == n
    assert producer.connector.held.stats().transfers == 1
    assert producer.kv.pool.num_used_blocks == 0  # the hold is a copy: the pool's blocks are free
    remote = pull_from(producer, consumer, "h0", prompt, out.held.keys)
    assert remote is not None and remote.first == 0 and len(remote.keys) == n
    tokens, cached = decode(consumer, "d0", prompt, remote)
    assert tokens == reference[0]
    assert cached == n * BS
    assert consumer.kv.remote.landed_blocks == n
    assert producer.connector.held.stats().transfers == 0  # one pull spends the hold


def test_only_the_blocks_the_decode_pool_lacks_are_pulled(
    producer, consumer, shared_prefix_prompts, reference
) -> None:  # noqa: ANN001
    """The prompts share a long system prompt: once the decode pod holds it, a second prompt pulls only its
    own tail."""
    first, second = shared_prefix_prompts[1], shared_prefix_prompts[2]
    decode(consumer, "warm", first, None)
    out = prefill(producer, "h1", second)
    remote = pull_from(producer, consumer, "h1", second, out.held.keys)
    shared = 0
    while first[: (shared + 1) * BS] == second[: (shared + 1) * BS]:
        shared += 1
    assert remote is not None and remote.first == shared > 0
    assert len(remote.keys) == (len(second) - 1) // BS - shared
    tokens, cached = decode(consumer, "d1", second, remote)
    assert tokens == reference[2]
    assert cached == (len(second) - 1) // BS * BS


def test_a_decode_reset_between_pull_and_landing_lands_nothing(
    producer, consumer, shared_prefix_prompts, reference
) -> None:  # noqa: ANN001
    prompt = shared_prefix_prompts[3]
    out = prefill(producer, "h3", prompt)
    remote = pull_from(producer, consumer, "h3", prompt, out.held.keys)
    consumer.reset_prefix_cache()  # the pulled blocks were computed before it: cold means cold
    tokens, cached = decode(consumer, "d3", prompt, remote)
    assert tokens == reference[3]
    assert cached == 0
    assert consumer.kv.remote.refused["local_reset"] == 1 and consumer.kv.remote.landed_blocks == 0


def test_a_prefix_evicted_before_landing_is_a_gap_not_a_partial_prefix(
    producer, consumer, shared_prefix_prompts, reference
) -> None:  # noqa: ANN001
    first, second = shared_prefix_prompts[1], shared_prefix_prompts[2]  # second's last blocks are its own
    decode(consumer, "warm", first, None)
    out = prefill(producer, "h5", second)
    remote = pull_from(producer, consumer, "h5", second, out.held.keys)
    assert remote is not None and remote.first > 0
    # other prompts fill the 48-block pool: the shared system prompt's blocks are evicted
    for i in range(3):
        decode(consumer, f"evict{i}", list(range(1000 + 400 * i, 1000 + 400 * i + 300)), None)
    tokens, cached = decode(consumer, "d5", second, remote)
    assert tokens == reference[2]
    assert cached == 0
    assert consumer.kv.remote.refused["gap"] == 1


def test_a_prefill_reset_drops_its_holds_at_once(producer, shared_prefix_prompts) -> None:  # noqa: ANN001
    out = prefill(producer, "h6", shared_prefix_prompts[0])
    epoch = out.held.epoch
    result = producer.reset_prefix_cache()
    assert result.success and result.dropped_holds == 1
    assert producer.connector.held.take("h6") is None
    assert producer.connector.held.epoch == epoch + 1


def test_a_prefill_that_a_reset_crossed_holds_nothing(producer, shared_prefix_prompts) -> None:  # noqa: ANN001
    """Its KV began before the reset: held, it would reach a decode pod after it."""
    prompt = shared_prefix_prompts[1]
    producer.reset_prefix_cache()  # nothing of the prompt cached: its prefill takes several steps
    producer.submit(EngineRequest("h7", prompt, SamplingParams(max_tokens=1), kv_hold="h7"))
    producer.config.max_num_batched_tokens, budget = 32, producer.config.max_num_batched_tokens
    producer.scheduler.max_num_batched_tokens = 32  # prefill in chunks: the reset lands between two
    try:
        assert producer.step() == []  # the first chunk: no token yet
        producer.reset_prefix_cache()
        last = None
        while producer.has_unfinished_requests():
            for o in producer.step():
                last = o
    finally:
        producer.config.max_num_batched_tokens = producer.scheduler.max_num_batched_tokens = budget
    assert last is not None and last.finished and last.held is not None and last.held.keys == ()
    assert producer.connector.held.stats().transfers == 0
