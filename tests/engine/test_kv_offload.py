"""The second KV tier on the real model: a prefix pushed out of a small pool comes back from host memory or
disk with the tokens of a cold run, counts as cached, and no reset, however it falls among the copies,
leaves anything servable."""

from __future__ import annotations

import random

import pytest

from kvpilot.daemon.engine.request import RequestStatus, SamplingParams
from kvpilot.kv.reset_scope import ResetScope
from support.engine import request_of, run_alone

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
POOL_BLOCKS = 24  # 384 tokens: the shared-prefix prompts (~120 tokens) push each other out
HOST_GIB = 64 * 737_280 / 2**30  # 64 blocks of the default model's fp32 KV
ROUNDS = 12  # of the reset soak, one reset each


def run_one(engine, rid: str, prompt: list[int]) -> tuple[list[int], int]:  # noqa: ANN001
    return run_alone(engine, rid, prompt, PARAMS)


def flush_pool(engine, prompts: list[list[int]], tag: str) -> None:  # noqa: ANN001
    """Run other prompts until the pool has evicted everything it cached before."""
    for i, p in enumerate(prompts):
        run_one(engine, f"{tag}-{i}", p)


@pytest.fixture(scope="module")
def cold(make_engine, shared_prefix_prompts) -> list[list[int]]:  # noqa: ANN001
    eng = make_engine(enable_prefix_caching=False)
    return [run_one(eng, f"cold{i}", p)[0] for i, p in enumerate(shared_prefix_prompts)]


@pytest.fixture
def long_prompts(tokenizer) -> list[list[int]]:  # noqa: ANN001
    """Unrelated prompts of ~300 tokens: two of them fill the small pool."""
    rng = random.Random(7)
    return [[rng.randrange(1000, 40000) for _ in range(300)] for _ in range(3)]


@pytest.mark.parametrize("tier", ["host", "disk", "host+disk"])
def test_evicted_prefix_comes_back_from_the_tier(
    make_engine, shared_prefix_prompts, long_prompts, cold, tier, tmp_path
) -> None:  # noqa: ANN001
    opts = {}
    if "host" in tier:
        # host+disk: a host tier of 4 blocks spills the rest of the prefix to disk
        opts["kv_offloading_size"] = HOST_GIB if tier == "host" else 4 * 737_280 / 2**30
    if "disk" in tier:
        opts["kv_offloading_dir"] = str(tmp_path / "kv")
    eng = make_engine(num_kv_blocks=POOL_BLOCKS, **opts)
    prompt = shared_prefix_prompts[0]
    first, cached = run_one(eng, "a", prompt)
    assert cached == 0 and first == cold[0]
    flush_pool(eng, long_prompts, "flush")
    wait_for_disk(eng)
    stats = eng.stats()
    assert sum(t.blocks for t in stats.offload) > 0, stats.offload

    again, cached_again = run_one(eng, "b", prompt)
    full_blocks = (len(prompt) - 1) // 16
    assert cached_again == full_blocks * 16, "the whole prefix came back from the tiers"
    assert again == cold[0], "token-identical to a cold run"
    tiers = {t.tier: t for t in eng.stats().offload}
    assert sum(t.hit_tokens for t in tiers.values()) == cached_again
    assert sum(t.loaded_blocks for t in tiers.values()) == full_blocks
    if tier == "host+disk":  # the host tier holds the last 4 blocks evicted: the flush's, not the prefix
        assert tiers["disk"].loaded_blocks == full_blocks and tiers["host"].stored_blocks > 4
    eng.close()


def wait_for_disk(engine) -> None:  # noqa: ANN001
    """The disk writer runs off the engine's thread: let it catch up, and tell the events (as a step does)."""
    disk = engine.kv.offload.disk
    if disk is not None:
        assert disk.flush(30)
        engine.kv.offload.poll()


def test_reset_clears_every_tier(make_engine, shared_prefix_prompts, long_prompts, tmp_path) -> None:  # noqa: ANN001
    eng = make_engine(
        num_kv_blocks=POOL_BLOCKS,
        kv_offloading_size=4 * 737_280 / 2**30,
        kv_offloading_dir=str(tmp_path / "kv"),
    )
    prompt = shared_prefix_prompts[1]
    run_one(eng, "a", prompt)
    flush_pool(eng, long_prompts, "flush")
    wait_for_disk(eng)
    before = {t.tier: t.blocks for t in eng.stats().offload}
    assert before["host"] > 0 and before["disk"] > 0

    result = eng.reset_prefix_cache()
    assert result.evicted_by_tier["host"] == before["host"]
    assert result.evicted_by_tier["disk"] == before["disk"]
    assert all(t.blocks == 0 for t in eng.stats().offload)
    _, cached = run_one(eng, "b", prompt)
    assert cached == 0
    eng.close()


def test_a_scoped_reset_clears_its_blocks_in_every_tier_and_keeps_the_rest(
    make_engine, shared_prefix_prompts, long_prompts, tmp_path
) -> None:  # noqa: ANN001
    """A reset of one salt: its blocks leave the pool, the host tier and the disk tier, the other salt's stay
    there and are served (a host tier of 8 blocks spills the rest to disk)."""
    eng = make_engine(
        num_kv_blocks=POOL_BLOCKS,
        kv_offloading_size=8 * 737_280 / 2**30,
        kv_offloading_dir=str(tmp_path / "kv"),
    )
    prompt = shared_prefix_prompts[1]
    full = (len(prompt) - 1) // 16 * 16
    run_alone(eng, "a", prompt, PARAMS, "tenant-a")
    run_alone(eng, "b", prompt, PARAMS, "tenant-b")
    flush_pool(eng, long_prompts, "flush")  # both prefixes now in the host and disk tiers
    wait_for_disk(eng)
    before = {t.tier: t.blocks for t in eng.stats().offload}
    assert before["host"] > 0 and before["disk"] > 0

    result = eng.reset_prefix_cache(scope=ResetScope(cache_salt="tenant-a"))
    assert result.scope == {"cache_salt": "tenant-a"} and result.epoch == 0
    gone = result.evicted_by_tier
    assert gone["host"] + gone["disk"] >= full // 16  # tenant-a's prefix, wherever it was
    after = {t.tier: t.blocks for t in eng.stats().offload}
    assert after == {tier: before[tier] - gone[tier] for tier in ("host", "disk")}
    assert after["host"] + after["disk"] > 0  # tenant-b's and the flush's stay
    assert run_alone(eng, "b2", prompt, PARAMS, "tenant-b")[1] == full  # still warm, from the tiers
    assert run_alone(eng, "a2", prompt, PARAMS, "tenant-a")[1] == 0
    eng.close()


def test_reset_during_copies_serves_nothing_stale(make_engine, tmp_path) -> None:  # noqa: ANN001
    """Resets fall at every point of runs that keep moving blocks between pool, host and disk (six
    unrelated prompts, preempting each other in a pool that holds two); a prompt is never a hit at its
    admission unless it was computed since the last reset."""
    eng = make_engine(
        num_kv_blocks=POOL_BLOCKS,
        kv_offloading_size=4 * 737_280 / 2**30,
        kv_offloading_dir=str(tmp_path / "kv"),
    )
    rng = random.Random(3)
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randrange(40, 200))] for _ in range(6)]
    fresh: set[int] = set()  # prompts computed since the last reset
    resets = stale = hits = 0
    for round_ in range(ROUNDS):
        pending = {f"r{round_}-{i}": i for i in rng.sample(range(len(prompts)), len(prompts))}
        for rid, i in pending.items():
            eng.add_request(rid, prompts[i], PARAMS)
        reset_at, step = rng.randrange(1, 12), 0
        while eng.has_unfinished_requests():
            eng.step()
            step += 1
            for rid, i in list(pending.items()):
                req = request_of(eng, rid)
                if req is None or req.status is RequestStatus.RUNNING:  # admitted (or done) in this step
                    del pending[rid]
                    if req is not None and req.num_cached_tokens > 0:
                        hits += 1
                        stale += i not in fresh
                    fresh.add(i)
            if step == reset_at:
                eng.reset_prefix_cache()
                resets += 1
                fresh.clear()
        if round_ % 3 == 0:
            wait_for_disk(eng)
    assert (resets, stale) == (ROUNDS, 0) and hits > 0, (resets, stale, hits)
    eng.close()


def test_disk_tier_survives_a_restart_but_not_a_reset(
    make_engine, shared_prefix_prompts, long_prompts, tmp_path
) -> None:  # noqa: ANN001
    kv_dir = str(tmp_path / "kv")
    eng = make_engine(num_kv_blocks=POOL_BLOCKS, kv_offloading_dir=kv_dir)
    run_one(eng, "a", shared_prefix_prompts[2])
    flush_pool(eng, long_prompts, "flush")
    wait_for_disk(eng)
    eng.close()

    restarted = make_engine(num_kv_blocks=POOL_BLOCKS, kv_offloading_dir=kv_dir)
    _, cached = run_one(restarted, "b", shared_prefix_prompts[2])
    assert cached > 0, "a restart of the same checkpoint keeps the disk tier"
    run_one(restarted, "c", shared_prefix_prompts[3])
    flush_pool(restarted, long_prompts, "flush")
    wait_for_disk(restarted)
    restarted.reset_prefix_cache()
    restarted.close()

    after_reset = make_engine(num_kv_blocks=POOL_BLOCKS, kv_offloading_dir=kv_dir)
    assert len(after_reset.kv.offload.disk) == 0
    _, cached = run_one(
        after_reset, "d", shared_prefix_prompts[3]
    )  # its blocks were on disk before the reset
    assert cached == 0, "nothing from before the reset is served after a restart"
    after_reset.close()


def test_new_weights_clear_every_tier(make_engine, shared_prefix_prompts, long_prompts) -> None:  # noqa: ANN001
    eng = make_engine(num_kv_blocks=POOL_BLOCKS, kv_offloading_size=HOST_GIB)
    run_one(eng, "a", shared_prefix_prompts[4])
    flush_pool(eng, long_prompts, "flush")
    assert eng.stats().offload[0].blocks > 0
    eng.set_weight_version("v2")  # what a weight swap does once the new weights are in
    assert eng.stats().offload[0].blocks == 0
    _, cached = run_one(eng, "b", shared_prefix_prompts[4])
    assert cached == 0
