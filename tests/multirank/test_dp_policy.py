"""The rank-choice policy and the CPU split, as pure functions."""

from __future__ import annotations

import pytest

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.parallel import placement
from kvpilot.daemon.engine.parallel.dp_policy import PrefixAwarePolicy
from kvpilot.daemon.engine.parallel.placement import cpu_shares, rank_configs
from kvpilot.kv.block_keys import key_scheme

SYSTEM = list(range(100, 164))  # four full blocks of 16


def keys(tail: list[int], salt: str | None = None) -> list:
    return key_scheme().prompt_hashes(SYSTEM + tail, 16, salt)


def test_shared_prefix_sticks_to_one_rank_within_the_load_slack() -> None:
    policy = PrefixAwarePolicy(2, load_slack=2)
    first = policy.choose(keys([1] * 20), [0, 0], [0, 1])
    loads = [0, 0]
    loads[first] += 1
    assert policy.choose(keys([2] * 20), loads, [0, 1]) == first  # prefix wins over the idle rank
    loads[first] += 2  # now 3 ahead of the other: beyond the slack
    other = policy.choose(keys([3] * 20), loads, [0, 1])
    assert other != first
    assert policy.matched_blocks(other, keys([4] * 20)) == 4  # and the other rank learnt the prefix


def test_unrelated_prompts_balance_by_load_then_round_robin() -> None:
    policy = PrefixAwarePolicy(3)
    assert policy.choose(key_scheme().prompt_hashes(list(range(40)), 16, None), [2, 0, 1], [0, 1, 2]) == 1
    assert policy.choose(key_scheme().prompt_hashes(list(range(500, 540)), 16, None), [0, 0, 0], [0, 2]) == 2
    assert policy.choose(key_scheme().prompt_hashes(list(range(600, 640)), 16, None), [0, 0, 0], [0, 2]) == 0


def test_salt_separates_prefixes_and_forget_clears_a_rank() -> None:
    policy = PrefixAwarePolicy(2)
    rank = policy.choose(keys([1] * 16, "tenant-a"), [0, 0], [0, 1])
    assert policy.matched_blocks(rank, keys([1] * 16, "tenant-b")) == 0
    assert policy.matched_blocks(rank, keys([1] * 16, "tenant-a")) == 5
    policy.forget(rank)
    assert policy.matched_blocks(rank, keys([1] * 16, "tenant-a")) == 0


def test_only_live_ranks_are_chosen_and_memory_is_bounded() -> None:
    policy = PrefixAwarePolicy(2, keys_per_rank=3)
    assert policy.choose(keys([]), [0, 0], [1]) == 1
    assert policy.matched_blocks(1, keys([])) == 0  # only the 3 newest keys are kept: the head is gone
    with pytest.raises(ValueError):
        policy.choose(keys([]), [0, 0], [])


@pytest.mark.parametrize(
    ("ranks", "cpus", "shares"),
    [
        (2, [0, 1], [[0], [1]]),
        (2, [0, 1, 2, 3, 4], [[0, 1, 2], [3, 4]]),
        (3, [4, 5], [[4], [5], [4]]),
    ],
)
def test_cpu_shares(ranks: int, cpus: list[int], shares: list[list[int]]) -> None:
    assert cpu_shares(ranks, cpus) == shares


@pytest.mark.parametrize(
    ("cpus", "ranks", "threads", "shares", "want_threads"),
    [
        ([0, 1, 2, 3], 1, None, [[0, 1, 2]], [3]),  # --engine-process: all but one, the server's
        ([0, 1], 1, None, [[0]], [1]),
        ([5], 1, None, [[5]], [1]),  # one CPU: the engine's, shared
        ([0, 1, 2, 3], 1, 4, [[0, 1, 2, 3]], [4]),  # --cpu-threads: pinned to all
        ([0, 1, 2, 3], 2, None, [[0, 1], [2, 3]], [2, 2]),  # data parallel: every CPU shared out
    ],
)
def test_rank_placement_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
    cpus: list[int],
    ranks: int,
    threads: int | None,
    shares: list[list[int]],
    want_threads: list[int],
) -> None:
    monkeypatch.setattr(placement.os, "sched_getaffinity", lambda _pid: set(cpus))
    monkeypatch.setattr(placement, "available_cpus", lambda: len(cpus))
    config = EngineConfig(
        device="cpu", cpu_threads=threads, engine_process=ranks == 1, data_parallel_size=ranks
    )
    configs, got = rank_configs(config, ranks)
    assert got == shares and [c.cpu_threads for c in configs] == want_threads
