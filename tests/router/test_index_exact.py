"""The router's index, fed only by KV events, equals the engine's own prefix index after every step,
whatever the sequence of add / abort / step / reset (with preemption and LRU eviction), and predicts
exactly the hits the engine then finds. Plus the pure parts: matching, distrust, policies, endpoints."""

from __future__ import annotations

import pytest
from engine.test_accounting import SHARED_PREFIXES, ops  # the same random operations as the pool's test
from hypothesis import HealthCheck, given, settings

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.kv.recorder import KVEventRecorder
from kvpilot.daemon.engine.request import SamplingParams
from kvpilot.kv.block_keys import key_scheme
from kvpilot.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
)
from kvpilot.kv.reset_scope import ResetScope
from kvpilot.router.fleet.pods import Pod, parse_endpoints
from kvpilot.router.kv import index as index_module
from kvpilot.router.kv.index import PrefixIndex
from kvpilot.router.routing.policy import LeastLoad, PrefixAware, RoundRobin
from kvpilot.router.routing.prompts import Prompts

BS = 4


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:  # noqa: ANN001
    eng = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir),
            block_size=BS,
            num_kv_blocks=24,
            max_num_batched_tokens=32,
            max_num_seqs=6,
            enable_pinned_prefix=True,  # pinned blocks stay indexed: the router must keep seeing them
            pinned_prefix_cap_ratio=0.25,
        )
    )
    eng.kv.pool.events = KVEventRecorder(BS)  # the publisher's recorder, without the sockets
    return eng


def sync(eng: LLMEngine, index: PrefixIndex) -> None:
    # Through the wire encoding, as the router receives it.
    batch = decode_batch(encode_batch(EventBatch(0.0, eng.kv.pool.events.drain())))
    index.apply("pod", batch)
    truth = eng.kv.pool.indexed_keys()
    assert index.num_blocks("pod") == len(truth)
    assert all(index.matched_blocks([k], ["pod"])["pod"] == 1 for k in truth)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_index_from_events_equals_the_engine_index(engine: LLMEngine, ops: list) -> None:
    index = PrefixIndex()
    engine.reset_prefix_cache()
    engine.kv.pool.events.drain()
    added: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, n, max_tokens, prefix, salt, seqs, pin = op  # seqs > 1: forks sharing the prompt's blocks
            prompt = SHARED_PREFIXES[prefix] + [3000 + (7 * len(added) + i) % 500 for i in range(n)]
            # What the router predicts must be what the engine finds when it looks the prompt up.
            usable = (len(prompt) - 1) // BS
            keys = key_scheme().prompt_hashes(prompt[: usable * BS], BS, salt)
            predicted = index.matched_blocks(keys, ["pod"])["pod"] * BS
            rid = f"q{len(added)}-{id(ops)}"
            req = engine.add_request(
                rid, prompt, SamplingParams(max_tokens=max_tokens, n=seqs), cache_salt=salt, pin_prefix=pin
            )[0]
            assert engine.kv.find_prefix(req).num_tokens == predicted
            added.append(rid)
        elif op[0] == "abort" and added:
            engine.abort_request(added[op[1] % len(added)])
        elif op[0] == "step":
            for _ in range(op[1]):
                if engine.has_unfinished_requests():
                    engine.step()
        elif op[0] == "reset":
            engine.reset_prefix_cache(reset_running_requests=op[1])
        elif op[0] == "unpin":
            engine.unpin_prefixes(None if op[1] is None else ResetScope(cache_salt=op[1]))
        sync(engine, index)
    for rid in added:
        engine.abort_request(rid)
    engine.kv.pool.events.drain()


def test_matching_stops_at_the_first_missing_block_and_distrust_holds_until_a_clear() -> None:
    k1, k2, k3 = (bytes([i]) * 32 for i in (1, 2, 3))
    index = PrefixIndex()
    index.store("a", [k1, k2, k3])
    index.store("b", [k1, k3])
    assert index.matched_blocks([k1, k2, k3], ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    index.distrust("a")
    index.apply("a", EventBatch(0.0, [BlockStored([k1], None, [0] * 4, 4)]))
    assert index.num_blocks("a") == 0  # pre-reset events still arriving are ignored
    index.apply("a", EventBatch(0.0, [AllBlocksCleared(), BlockStored([k1], None, [0] * 4, 4)]))
    assert index.num_blocks("a") == 1 and index.clears("a") == 1


def test_expected_keys_count_until_confirmed_dropped_or_expired(monkeypatch: pytest.MonkeyPatch) -> None:
    k1, k2, k3 = (bytes([i]) * 32 for i in (1, 2, 3))
    now = [100.0]
    monkeypatch.setattr(index_module.time, "monotonic", lambda: now[0])
    index = PrefixIndex()
    index.store("a", [k1])
    index.expect("a", [k1, k2, k3, b"short"])  # a malformed hash is never expected
    assert index.matched_blocks([k1, k2, k3], ["a"]) == {"a": 1}  # confirmed only
    assert index.matched_blocks([k1, k2, k3], ["a"], expected=True) == {"a": 3}
    index.apply("a", EventBatch(0.0, [BlockRemoved([k2])]))  # evicted before it was confirmed
    assert index.matched_blocks([k1, k2, k3], ["a"], expected=True) == {"a": 1}
    index.expect("b", [k1, k2])
    now[0] += index_module.EXPECTED_TTL_S + 1
    assert index.matched_blocks([k1, k2], ["b"], expected=True) == {"b": 0}  # expired
    index.expect("b", [k1, k2])
    index.apply("b", EventBatch(0.0, [AllBlocksCleared()]))
    assert index.matched_blocks([k1, k2], ["b"], expected=True) == {"b": 0}  # a clear drops them too
    index.distrust("c")
    index.expect("c", [k1])  # sent before a reset's clear came: not counted
    assert index.matched_blocks([k1], ["c"], expected=True) == {"c": 0}
    monkeypatch.setattr(index_module, "MAX_EXPECTED_PER_HOLDER", 2)
    index.expect("d", [k1, k2, k3])  # the oldest goes first
    assert index.matched_blocks([k2, k3], ["d"], expected=True) == {"d": 2}
    assert index.matched_blocks([k1], ["d"], expected=True) == {"d": 0}


def test_expired_expected_keys_leave_the_pools_room_and_are_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """room() counts the keys a holder was just sent, until they expire; expired ones are dropped, not
    scanned on every call (a pod whose events never confirm what it was sent would make each cold
    prompt's choice cost a pass over up to MAX_EXPECTED_PER_HOLDER keys)."""
    now = [100.0]
    monkeypatch.setattr(index_module.time, "monotonic", lambda: now[0])
    index = PrefixIndex()
    index.set_capacity("a", 64)
    index.store("a", [bytes([1]) * 32])
    for second in range(10):  # ten sends a second apart, 4 new keys each, never confirmed
        index.expect("a", [bytes([2 + 4 * second + j]) * 32 for j in range(4)])
        now[0] += 1.0
    assert index.room("a") == 64 - 1 - 40
    now[0] += index_module.EXPECTED_TTL_S - 5.5  # the first five sends have expired
    assert index.room("a") == 64 - 1 - 20
    assert len(index._expected["a"]) == 20
    index.expect("a", [bytes([2]) * 32])  # sent again: expected anew, with the newest
    assert index.room("a") == 64 - 1 - 21
    now[0] += index_module.EXPECTED_TTL_S
    assert index.room("a") == 64 - 1 and not index._expected["a"]


def test_a_prompt_just_sent_draws_the_next_one_to_its_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests with one new prefix: the second goes to the rank the first was sent to, although no
    event has named the blocks yet; what is reported as predicted stays what the events confirmed."""
    monkeypatch.setattr(Pod, "synced", lambda self: True)
    index = PrefixIndex()
    prompt = list(range(400))  # 99 blocks of 4 outweigh the first request's load (64 tokens)
    dp = pod("dp:1", ranks=2)
    pa = PrefixAware(index)
    first = pa.choose([dp], Prompts([prompt], None))
    dp.opened(first.rank)
    second = pa.choose([dp], Prompts([prompt[:396] + [9] * 4], None))
    assert (second.rank, second.reason, second.predicted_cached_tokens) == (first.rank, "prefix", 0)


def pod(name: str, in_flight: int = 0, ranks: int = 1) -> Pod:
    return Pod(
        name,
        f"http://{name}",
        ready=True,
        in_flight=in_flight,
        kv_events="on",
        block_size=BS,
        ranks=list(range(ranks)),
    )


def test_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Pod, "synced", lambda self: True)
    index = PrefixIndex()
    prompt = list(range(40))  # 9 usable blocks of 4
    index.store(("b:1", 0), key_scheme().prompt_hashes(prompt[:36], BS))
    a, b = pod("a:1"), pod("b:1")
    pa = PrefixAware(index)
    d = pa.choose([a, b], Prompts([prompt], None))
    assert (d.pod, d.reason, d.predicted_cached_tokens, d.rank) == (b, "prefix", 36, None)
    # another tenant's salt shares nothing
    assert pa.choose([a, b], Prompts([prompt], "other")).predicted_cached_tokens == 0
    b.in_flight = 1  # 36 cached tokens outweigh one open request (32 tokens): 40-36+32 < 40
    assert pa.choose([a, b], Prompts([prompt], None)).pod is b
    b.in_flight = 2  # but not two: 40-36+64 > 40
    assert pa.choose([a, b], Prompts([prompt], None)).pod is a
    assert LeastLoad().choose([a, b], None).pod is a
    rr = RoundRobin()
    assert [rr.choose([a, b], None).pod for _ in range(3)] == [a, b, a]


def test_a_cold_prompt_goes_where_it_evicts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pools of 20 blocks: a full one (b) and one just reset (a). A prompt no pod holds goes to a, although
    a has one more request open (two against one): storing its 10 blocks in b would push 10 cached blocks
    out. A prompt b holds stays there. With both pools full alike, or a pool of unknown size among them,
    load decides."""
    monkeypatch.setattr(Pod, "synced", lambda self: True)
    index = PrefixIndex()
    for holder in (("a:1", 0), ("b:1", 0)):
        index.set_capacity(holder, 20)
    warm = list(range(1000, 1041))
    index.store(("b:1", 0), key_scheme().prompt_hashes(warm[:40], BS))
    index.store(("b:1", 0), key_scheme().prompt_hashes(list(range(2000, 2040)), BS))  # b is full
    a, b = pod("a:1", in_flight=2), pod("b:1", in_flight=1)
    pa = PrefixAware(index)
    cold = list(range(41))
    # A pod whose pool size is unknown (a vLLM pod, an older daemon) beside them: room is not compared.
    c = pod("c:1", in_flight=2)
    assert pa.choose([a, b, c], Prompts([list(range(7000, 7041))], None)).pod is b
    assert pa.choose([a, b], Prompts([cold], None)).pod is a
    assert pa.choose([a, b], Prompts([warm], None)).pod is b
    index.store(("a:1", 0), key_scheme().prompt_hashes(list(range(3000, 3080)), BS))  # a full as well
    assert pa.choose([a, b], Prompts([list(range(5000, 5041))], None)).pod is b


def test_an_eviction_outweighs_a_request_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pools of 20 blocks: b holds 16 (fill 0.8), a was just reset and has one request open more than b
    (two against one). A cold prompt of 10 blocks (40 tokens) would give 0.8 of them to b's cached blocks:
    counted once, 32 tokens, no more than a's extra open request, and b (less loaded) would take it;
    counted twice (the prefix computed again later, and what that evicts), it goes to a."""
    monkeypatch.setattr(Pod, "synced", lambda self: True)
    index = PrefixIndex()
    for holder in (("a:1", 0), ("b:1", 0)):
        index.set_capacity(holder, 20)
    index.store(("b:1", 0), key_scheme().prompt_hashes(list(range(1000, 1064)), BS))
    assert index.room(("b:1", 0)) == 4
    a, b = pod("a:1", in_flight=2), pod("b:1", in_flight=1)
    assert PrefixAware(index).choose([a, b], Prompts([list(range(41))], None)).pod is a


def test_a_cached_prompt_spills_into_a_full_pool_only_for_what_its_copy_would_evict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pools of 20 blocks, both full: a holds 9 blocks (36 tokens) of a 41-token prompt and 11 others, b 20
    others. With 3 requests open on a, the prompt stays there (5 tokens to compute, 4 of them stored: 8
    evicted at twice, 96 for the load: 109), where b would compute 41 and evict twice 40 (121): counting the
    recompute alone (5 + 96 against 41) it would spill. With 4 open on a it spills (141 against 121). Into a
    pool just reset, which a copy evicts nothing from, it spills with 1 open (45 against 41)."""
    monkeypatch.setattr(Pod, "synced", lambda self: True)
    prompt = list(range(41))

    def choice(open_on_a: int, b_full: bool = True) -> Pod:
        a.in_flight = open_on_a
        index = PrefixIndex()
        for holder in (("a:1", 0), ("b:1", 0)):
            index.set_capacity(holder, 20)
        index.store(("a:1", 0), key_scheme().prompt_hashes(prompt[:36], BS))
        index.store(("a:1", 0), key_scheme().prompt_hashes(list(range(1000, 1044)), BS))
        if b_full:
            index.store(("b:1", 0), key_scheme().prompt_hashes(list(range(2000, 2080)), BS))
        assert (index.fill(("a:1", 0)), index.fill(("b:1", 0))) == (1.0, 1.0 if b_full else 0.0)
        return PrefixAware(index).choose([a, b], Prompts([prompt], None)).pod

    a, b = pod("a:1"), pod("b:1")
    assert choice(3) is a
    assert choice(4) is b
    assert choice(0, b_full=False) is a
    assert choice(1, b_full=False) is b


def test_prefix_aware_picks_the_rank_of_a_data_parallel_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Pod, "synced", lambda self: True)
    index = PrefixIndex()
    prompt = list(range(40))
    index.store(("dp:1", 1), key_scheme().prompt_hashes(prompt[:36], BS))  # only rank 1 holds the prefix
    a, dp = pod("a:1"), pod("dp:1", ranks=2)
    pa = PrefixAware(index)
    d = pa.choose([a, dp], Prompts([prompt], None))
    assert (d.pod, d.rank, d.predicted_cached_tokens) == (dp, 1, 36)
    # Load counts per rank: rank 1 busy, the prefix moves on; rank 0 idle is as good as the other pod.
    dp.opened(1)
    dp.opened(1)
    d = pa.choose([a, dp], Prompts([prompt], None))
    assert d.predicted_cached_tokens == 0 and (d.pod, d.rank) in ((a, None), (dp, 0))


def test_endpoints_are_parsed_and_checked() -> None:
    pods = parse_endpoints("http://10.0.0.1:8000, 10.0.0.2:8001")
    assert [(p.name, p.url, p.port) for p in pods] == [
        ("10.0.0.1:8000", "http://10.0.0.1:8000", 8000),
        ("10.0.0.2:8001", "http://10.0.0.2:8001", 8001),
    ]
    for bad in ("", "ftp://x:1", "http://a:1,http://a:1"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)


def test_a_cold_prompt_goes_to_the_emptier_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pools of 20 blocks, both with room for a cold prompt of 10 blocks: a holds 12 (fill 0.6), b nothing
    but has one request open more than a (two against one). By load, and by what must be evicted now
    (nothing on either), a would take it and hold two prompts while b holds none: a's cached blocks would
    go later. It goes to b."""
    monkeypatch.setattr(Pod, "synced", lambda self: True)
    index = PrefixIndex()
    for holder in (("a:1", 0), ("b:1", 0)):
        index.set_capacity(holder, 20)
    index.store(("a:1", 0), key_scheme().prompt_hashes(list(range(1000, 1048)), BS))
    assert (index.fill(("a:1", 0)), index.fill(("b:1", 0))) == (0.6, 0.0)
    a, b = pod("a:1", in_flight=1), pod("b:1", in_flight=2)
    assert PrefixAware(index).choose([a, b], Prompts([list(range(41))], None)).pod is b


def test_an_idle_rank_takes_a_new_prompt_before_a_busy_one_with_more_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The emptier pool (b, nothing cached) with a request open, a fuller one (a, fill 0.6) idle: a prompt
    new to the fleet goes to a, where it waits behind nothing, not to b, where it may wait for the open
    request's prefill. A prompt sent before, cached nowhere now, is not held to the idle rank: it is scored
    as before, its home spared the eviction charge
    (test_a_prompt_cached_nowhere_goes_back_to_the_rank_it_was_sent_to_last)."""
    monkeypatch.setattr(Pod, "synced", lambda self: True)
    index = PrefixIndex()
    for holder in (("a:1", 0), ("b:1", 0)):
        index.set_capacity(holder, 20)
    index.store(("a:1", 0), key_scheme().prompt_hashes(list(range(1000, 1048)), BS))
    a, b = pod("a:1"), pod("b:1")
    policy = PrefixAware(index)
    homed = list(range(5000, 5041))
    assert policy.choose([a, b], Prompts([homed], None)).pod is b  # both idle: the emptier pool
    index.remove(("b:1", 0), key_scheme().prompt_hashes(homed[:40], BS))  # (what that choice expects there)
    b.in_flight = 1
    assert policy.choose([a, b], Prompts([list(range(41))], None)).pod is a
    assert policy.choose([a, b], Prompts([homed], None)).pod is b  # busy b, its home: scored as before


def test_an_idle_rank_of_a_data_parallel_pod_takes_a_new_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle is per rank: rank 0 of a data-parallel pod, its pool empty, has a request open; rank 1, fuller,
    has none. A prompt new to the fleet goes to rank 1 (by the pod's count, both would look busy and the
    emptier rank 0 would take it)."""
    monkeypatch.setattr(Pod, "synced", lambda self: True)
    index = PrefixIndex()
    for rank in (0, 1):
        index.set_capacity(("dp:1", rank), 20)
    index.store(("dp:1", 1), key_scheme().prompt_hashes(list(range(1000, 1048)), BS))
    dp = pod("dp:1", ranks=2)
    dp.opened(0)
    d = PrefixAware(index).choose([dp], Prompts([list(range(41))], None))
    assert (d.pod, d.rank) == (dp, 1)


def test_requests_sent_to_a_data_parallel_pod_without_a_rank_keep_its_ranks_from_looking_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A data-parallel pod has two requests open that named no rank (the pod's own balancer placed them: a
    body the router could not key), so each rank counts one; the single-rank pod beside it, fuller, has
    none open. A prompt new to the fleet goes to the idle pod, not to an emptier rank only the router's
    ranked count would call idle."""
    monkeypatch.setattr(Pod, "synced", lambda self: True)
    index = PrefixIndex()
    for holder in (("dp:1", 0), ("dp:1", 1), ("one:1", 0)):
        index.set_capacity(holder, 20)
    index.store(("one:1", 0), key_scheme().prompt_hashes(list(range(1000, 1048)), BS))
    dp, one = pod("dp:1", in_flight=2, ranks=2), pod("one:1")
    assert (dp.rank_load(0), dp.rank_load(1)) == (1, 1)
    d = PrefixAware(index).choose([dp, one], Prompts([list(range(41))], None))
    assert (d.pod, d.rank) == (one, None)


def test_a_prompt_cached_nowhere_goes_back_to_the_rank_it_was_sent_to_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pools of 20 blocks. A prompt of 10 blocks goes to a (b has a request open), then a evicts it for
    other blocks (12 of 20: fill 0.6) while b, idle now, stays empty: sent again, it goes back to a, where a
    prompt never sent goes to the emptier b (test_a_cold_prompt_goes_to_the_emptier_pool). Cached on b, it
    goes to b: a home only places a prompt cached nowhere."""
    monkeypatch.setattr(Pod, "synced", lambda self: True)
    index = PrefixIndex()
    for holder in (("a:1", 0), ("b:1", 0)):
        index.set_capacity(holder, 20)
    a, b = pod("a:1"), pod("b:1", in_flight=1)
    policy = PrefixAware(index)
    prompt = list(range(41))
    keys = key_scheme().prompt_hashes(prompt[:40], BS)
    assert policy.choose([a, b], Prompts([prompt], None)).pod is a
    b.in_flight = 0
    index.remove(("a:1", 0), keys)  # evicted: its BlockRemoved events
    index.store(("a:1", 0), key_scheme().prompt_hashes(list(range(1000, 1048)), BS))
    assert (index.fill(("a:1", 0)), index.fill(("b:1", 0))) == (0.6, 0.0)
    assert PrefixAware(index).choose([a, b], Prompts([prompt], None)).pod is b  # never sent: the emptier pool
    index.remove(("b:1", 0), keys)  # (what that choice expects there)
    assert policy.choose([a, b], Prompts([prompt], None)).pod is a
    index.remove(("a:1", 0), keys)
    index.store(("b:1", 0), keys[:4])
    d = policy.choose([a, b], Prompts([prompt], None))
    assert (d.pod, d.reason, d.predicted_cached_tokens) == (b, "prefix", 16)


def test_a_prompt_keyed_two_ways_goes_home_to_where_it_was_sent_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pods of two key schemes (a vLLM-keyed a, a kvpilot-keyed b) key one prompt two ways, so it has a home
    under each. Sent to a, then to b, then cached nowhere with both alike: it goes to b, whichever pod the
    tie-break order puts first (two choices, the order rotated between them)."""
    monkeypatch.setattr(Pod, "synced", lambda self: True)
    index = PrefixIndex()
    for holder in (("a:1", 0), ("b:1", 0)):
        index.set_capacity(holder, 20)
    a, b = pod("a:1"), pod("b:1", in_flight=1)
    b.keys = key_scheme("kvpilot")
    policy = PrefixAware(index)
    prompt = list(range(41))
    keys = {p.name: p.keys.prompt_hashes(prompt[:40], BS) for p in (a, b)}
    assert policy.choose([a, b], Prompts([prompt], None)).pod is a
    index.remove(("a:1", 0), keys["a:1"])  # (what that choice expects there)
    a.in_flight, b.in_flight = 1, 0
    assert policy.choose([a, b], Prompts([prompt], None)).pod is b
    a.in_flight = 0
    for _ in range(2):
        index.remove(("b:1", 0), keys["b:1"])
        assert policy.choose([a, b], Prompts([prompt], None)).pod is b
