"""Everything the router takes from a pod is bounded: pods that trickle, lie, flood or go silent
(tests/support/hostile_pod.py: real aiohttp and ZeroMQ sockets on loopback) cost the router a bounded
wait, bounded memory and that pod's own routing, never its availability."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from kvpilot.daemon.engine.kv.publisher import KVEventPublisher
from kvpilot.kv.block_keys import KeyScheme
from kvpilot.router.kv import stream as stream_module
from kvpilot.router.kv.index import MAX_BLOCKS_PER_HOLDER, PrefixIndex, index_key
from kvpilot.router.kv.info import REPLAY_MAX_BATCHES, parse_kv_event_sources, parse_kv_events
from kvpilot.router.kv.replay import ReplayError, ReplayLimits, fetch_replay
from kvpilot.router.kv.stream import PodEventStream
from kvpilot.router.proxy import _may_stream
from support.hostile_pod import HostilePod, random_keys, seq_frame, stored, stored_keys
from support.procs import wait_for
from support.servers import (
    ADMIN_TOKEN,
    MODEL,
    RouterProc,
    read_until_decoding,
    send_completion,
    start_daemon,
    start_router,
    stop_fleet,
    stop_router,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def pod() -> Iterator[HostilePod]:
    p = HostilePod()
    yield p
    p.stop()


def router_for(tmp: Path, pod: HostilePod, *flags: str, synced: bool = True) -> RouterProc:
    return start_router(tmp, [pod.url], "--policy", "round-robin", *flags, all_pods=synced)


def post(router: RouterProc, path: str, body: dict | bytes, timeout: float = 60) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=timeout)
    try:
        hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_TOKEN}"}
        conn.request(
            "POST", path, body=body if isinstance(body, bytes) else json.dumps(body).encode(), headers=hdrs
        )
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 4}


# ---- the reset's one deadline ----------------------------------------------------------------------
def test_a_trickling_replay_cannot_hold_a_reset_past_its_deadline(tmp_path: Path, pod: HostilePod) -> None:
    router = router_for(tmp_path, pod, "--reset-timeout", "6")
    try:
        # The clear is not sent live (as if PUB dropped it) and the replay trickles a batch a second,
        # each well within the silence limit, never ending: before the deadline, this held the answer.
        pod.publish_live = False
        pod.replay = "trickle"
        started = time.monotonic()
        status, body = post(router, "/reset_prefix_cache", {}, timeout=40)
        took = time.monotonic() - started
        assert status == 200, body
        (reply,) = json.loads(body)["pods"]
        assert reply["success"] and reply["index"] == "dropped", reply
        assert took < 6 + 10, took  # within --reset-timeout, with room for a loaded machine
        assert router.pod(pod.name)["indexed_blocks"] == 0
        assert "its entries are dropped" in router.log()
    finally:
        stop_router(router)


# ---- replay: capped by the advertised buffer --------------------------------------------------------
def fetch(endpoint: str, limits: ReplayLimits) -> list:
    async def go() -> list:
        ctx = zmq.asyncio.Context()
        try:
            return await fetch_replay(ctx, endpoint, 0, limits)
        finally:
            ctx.term()

    return asyncio.run(go())


def test_replay_is_capped_in_batches_and_bytes(pod: HostilePod) -> None:
    pod.replay = "flood"
    pod.flood_batches, pod.flood_payload = 50, 1000
    assert len(fetch(pod.replay_endpoint, ReplayLimits(batches=50, bytes=50_000))) == 50
    with pytest.raises(ReplayError, match="more than its buffer"):
        fetch(pod.replay_endpoint, ReplayLimits(batches=49, bytes=50_000))
    with pytest.raises(ReplayError, match="more than its buffer"):
        fetch(pod.replay_endpoint, ReplayLimits(batches=50, bytes=49_999))
    pod.replay = "trickle"
    with pytest.raises(ReplayError, match="no complete answer within 3 s"):
        fetch(pod.replay_endpoint, ReplayLimits(silence_s=2.0, total_s=3.0))
    # The advertised buffer sets the limits, within the router's own ceiling.
    info = {"endpoint": "tcp://127.0.0.1:1", "block_size": 16, "buffer_batches": 10**12, "buffer_bytes": 4096}
    limits = parse_kv_events(info).limits
    assert (limits.batches, limits.bytes) == (REPLAY_MAX_BATCHES, 4096)


def test_a_flooding_replay_is_refused_and_the_pod_indexed_from_its_live_events(pod: HostilePod) -> None:
    """The pod advertises 1,000 batches and answers a replay with 20,000 valid ones: refused whole."""
    for _ in range(3):
        pod.record(stored_keys(random_keys(4)))
    pod.replay = "flood"
    pod.flood_batches, pod.flood_payload = 20_000, 10

    async def go() -> tuple[bool, int]:
        ctx = zmq.asyncio.Context()
        index = PrefixIndex()
        events = parse_kv_events(_honest(pod))
        stream = PodEventStream(
            "p", pod.endpoint, pod.replay_endpoint, index, lambda *a: None, ctx, limits=events.limits
        )
        ok = await stream.catch_up()
        ctx.term()
        return ok, stream.last_seq

    ok, last = asyncio.run(go())
    assert not ok and last == -1


def test_a_long_replay_is_applied_in_slices_the_event_loop_runs_between(
    pod: HostilePod, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay answer may hold 64 MiB of batches (seconds to apply): it is applied in slices, the event
    loop free to serve requests and probes between them, as the live backlog is. With the slice cut to
    nothing, the loop runs between every two batches; applied in one go, it never did."""
    for _ in range(40):
        pod.record(stored_keys(random_keys(8)))
    monkeypatch.setattr(stream_module, "YIELD_AFTER_S", 0.0)

    async def go() -> tuple[bool, int, list[int]]:
        ctx = zmq.asyncio.Context()
        ticks, seen = [0], []
        stream = PodEventStream(
            "p",
            pod.endpoint,
            pod.replay_endpoint,
            PrefixIndex(),
            lambda *a: None,
            ctx,
            limits=parse_kv_events(_honest(pod)).limits,
        )
        apply = stream._apply

        def counted(seq: int, payload: bytes) -> None:
            seen.append(ticks[0])
            apply(seq, payload)

        stream._apply = counted  # type: ignore[method-assign]

        async def tick() -> None:
            while True:
                ticks[0] += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        ok = await stream.catch_up()
        ticker.cancel()
        ctx.term()
        return ok, stream.last_seq, seen

    ok, last, seen = asyncio.run(go())
    assert ok and last == 39 and len(seen) == 40
    assert len(set(seen)) == len(seen), seen  # the loop ran between every two batches


def _honest(pod: HostilePod) -> dict:
    return {
        "endpoint": pod.endpoint,
        "replay_endpoint": pod.replay_endpoint,
        "block_size": 16,
        "blocks_total": pod.blocks_total,
        "buffer_batches": pod.buffer_batches,
        "buffer_bytes": pod.buffer_bytes,
    }


# ---- live events: seq frames, forged floods, malformed hashes --------------------------------------
async def _follow(pod: HostilePod, index: PrefixIndex, blocks_total: int | None) -> tuple:
    ctx = zmq.asyncio.Context()
    counts: dict[str, int] = {}

    def count(_pod: str, result: str, n: int) -> None:
        counts[result] = counts.get(result, 0) + n

    stream = PodEventStream(
        "p", pod.endpoint, pod.replay_endpoint, index, count, ctx, idle_check_s=0.2, blocks_total=blocks_total
    )
    task = asyncio.create_task(stream.run())
    await asyncio.wait_for(stream.synced.wait(), 30)
    # Past the slow-joiner window: live batches reach the stream (not just the idle catch-ups).
    while not counts.get("received"):
        pod.record(stored_keys(random_keys(1)))
        await asyncio.sleep(0.2)
    return ctx, stream, task, counts


async def _until(check, what: str, timeout: float = 30) -> None:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.05)


def test_seq_frames_of_the_wrong_length_or_range_are_a_gap(pod: HostilePod) -> None:
    async def go() -> None:
        index = PrefixIndex()
        ctx, stream, task, counts = await _follow(pod, index, None)
        try:
            for bad in (b"\x00\x01", seq_frame(2**63 - 1), seq_frame(-5), seq_frame(2**62)):
                pod.send_raw([b"", bad, stored_keys(random_keys(1))])
            pod.send_raw([b"", seq_frame(1)])  # two frames, not three
            keys = random_keys(2)
            pod.record(stored_keys(keys))  # the next true batch, live and in the buffer
            await _until(lambda: index.matched_blocks(keys, [stream.key])[stream.key] == 2, "the next batch")
            await asyncio.sleep(1.0)  # a few idle catch-ups after the lies
            assert not task.done(), task
            assert stream.last_seq == len(pod.buffer) - 1
            assert counts.get("missed", 0) == 0, counts  # the replay had everything the lies hid
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            ctx.term()

    asyncio.run(go())


def test_the_index_holds_at_most_the_pods_blocks_and_only_block_keys(pod: HostilePod) -> None:
    """A forged BlockStored flood (40,000 valid keys for a pod of 64 blocks) and hashes of every wrong
    form: the pod's entry never passes 64 and holds none of the malformed ones."""

    async def go() -> None:
        index = PrefixIndex()
        ctx, stream, task, _ = await _follow(pod, index, pod.blocks_total)
        try:
            tracemalloc.start()
            for _ in range(40):
                pod.record(stored_keys(random_keys(1000)))
            bad = [-1, -(1 << 63), True, 2.5, "x" * 32, b"short", b"y" * 33, None, [b"z" * 32], bytearray(32)]
            pod.record(stored(bad))
            last = len(pod.buffer) - 1
            await _until(lambda: stream.last_seq == last, "the flood applied")
            held = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            assert index.num_blocks(stream.key) <= pod.blocks_total
            assert held < 8 << 20, held  # 40,000 indexed keys would hold more than 10 MB
            assert not task.done()
            good = random_keys(3)
            pod.record(stored_keys(good))
            await _until(lambda: index.matched_blocks(good, [stream.key])[stream.key] == 3, "good keys")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            ctx.term()

    asyncio.run(go())
    # what a key may be: 32 bytes, or vLLM's unsigned 64-bit integer form of them, the same index key
    key = random_keys(1)[0]
    assert index_key(key) == index_key(int.from_bytes(key[-8:], "big")) is not None
    assert [index_key(h) for h in (-1, 1 << 64, True, 2.5, b"y" * 33)] == [None] * 5
    index = PrefixIndex()
    index.set_capacity("h", 10**12)  # a pod may advertise anything: the router's ceiling holds
    index.set_capacity("h", None)
    assert index._capacity["h"] == MAX_BLOCKS_PER_HOLDER


def test_a_pod_costs_the_index_one_pods_ceiling_whatever_ranks_it_claims(
    tmp_path: Path, pod: HostilePod
) -> None:
    """A pod listing 16 ranks on its one PUB socket would have each key it sends indexed 16 times (16x the
    ceiling per pod): refused, and the pod routed by load. Ranks on sockets of their own share the pod's
    ceiling, whatever pools they advertise."""
    rank = {"endpoint": pod.endpoint, "blocks_total": 10**9}
    pod.kv_events_reply = {"block_size": 16, "ranks": [rank | {"rank": i} for i in range(16)]}
    router = router_for(tmp_path, pod, synced=False)
    try:
        status, _ = post(router, "/v1/completions", COMPLETION)
        assert status == 200  # routed by load
        wait_for(lambda: "two ranks name one endpoint" in router.log(), 30, "the reply refused")
        assert router.pod(pod.name)["kv_events"] != "on"
    finally:
        stop_router(router)
    ranks = [{"rank": i, "endpoint": f"tcp://127.0.0.1:{5000 + i}", "blocks_total": 10**9} for i in range(16)]
    parsed = parse_kv_events({"block_size": 16, "ranks": ranks})
    assert [r.blocks_total for r in parsed.ranks] == [MAX_BLOCKS_PER_HOLDER // 16] * 16
    ranks[3]["blocks_total"] = 100  # a smaller pool is its own bound
    assert parse_kv_events({"block_size": 16, "ranks": ranks}).ranks[3].blocks_total == 100
    vllm = {str(i): {"endpoint": f"tcp://*:{5557 + i}"} for i in range(4)}
    shares = [r.blocks_total for r in parse_kv_event_sources(vllm, "10.0.0.7", 16, KeyScheme("sha256")).ranks]
    assert shares == [MAX_BLOCKS_PER_HOLDER // 4] * 4


def test_index_memory_per_block_hash() -> None:
    """Issue 21's bound, at a size a test can afford (bench/index_memory.py measures 1M)."""
    n = 250_000
    keys = random_keys(n)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex()
    index.set_capacity("h", n)
    index.store("h", keys)
    per_key = (tracemalloc.get_traced_memory()[0] - before) / n
    tracemalloc.stop()
    assert index.num_blocks("h") == n
    assert per_key <= 120, per_key


# ---- the daemon advertises its bounds --------------------------------------------------------------
def test_the_publisher_bounds_its_buffer_in_bytes_and_says_so() -> None:
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_bytes=2000, blocks_total=64)
    try:
        for _ in range(40):
            pub.recorder.block_stored(random_keys(1), 0, list(range(16)))
            pub.flush()
        got = wait_for(
            lambda: (r := fetch(pub.replay_endpoint, ReplayLimits(bytes=2000))) and r[-1][0] == 39 and r,
            30,
            "the last batch buffered",
        )
        size = len(got[0][1])  # every batch here encodes to the same size
        assert len(got) == 2000 // size and [s for s, _ in got] == list(range(40 - len(got), 40))
        info = pub.describe("127.0.0.1")
        assert info["buffer_bytes"] == 2000 and info["blocks_total"] == info["ranks"][0]["blocks_total"] == 64
    finally:
        pub.close()


# ---- the pod's watch survives its answers -----------------------------------------------------------
@pytest.mark.parametrize(
    "reply",
    [
        [1, 2],
        {"block_size": "16", "endpoint": "tcp://127.0.0.1:1"},
        {"block_size": 16, "ranks": [{"endpoint": 5}]},
        {"block_size": 16, "ranks": 7},
        {"block_size": 16, "endpoint": "ipc:///tmp/router-own-socket"},
        # hosts libzmq refuses to connect to, which a looser pattern let through to fail every second
        {"block_size": 16, "endpoint": "tcp://-:5557"},
        {"block_size": 16, "endpoint": "tcp://_pod:5557"},
        {"block_size": 16, "endpoint": "tcp://pod..ns:5557"},
        {"block_size": 16, "endpoint": "tcp://127.0.0.1:1", "blocks_total": True},
    ],
)
def test_a_kv_events_reply_of_the_wrong_shape_is_refused(reply: object) -> None:
    with pytest.raises(ValueError):
        parse_kv_events(reply)


@pytest.mark.parametrize(
    "reply",
    [
        {
            "block_size": 16,
            "endpoint": "tcp://127.0.0.1:1",
            "block_hash": "sha256_cbor",
            "hash_seed": "\ud800",
        },
        {
            "block_size": 16,
            "endpoint": "tcp://127.0.0.1:1",
            "block_hash": "sha256_cbor",
            "hash_seed": "s" * 257,
        },
        {"block_size": 16, "endpoint": "tcp://127.0.0.1:1", "block_hash": "xxhash"},
        {"block_size": 16, "endpoint": "tcp://127.0.0.1:1", "block_hash": "sha256", "hash_seed": 7},
    ],
)
def test_a_key_scheme_the_router_cannot_compute_is_refused(reply: dict) -> None:
    """A seed CBOR cannot encode (a lone surrogate) is refused here, not at every request's keying."""
    with pytest.raises(ValueError):
        parse_kv_events(reply)


def test_vllms_kv_event_sources_are_read_and_checked() -> None:
    """vLLM 0.32's GET /kv_event_sources: each rank's publisher config keyed by rank; a wildcard bind is
    the pod's own address; `{}` means events are off."""
    keys = KeyScheme("sha256")
    rank = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": None,
    }
    got = parse_kv_event_sources({"1": rank | {"endpoint": "tcp://*:5558"}, "0": rank}, "10.0.0.7", 16, keys)
    assert got is not None and got.keys == keys and got.block_size == 16
    assert [(r.rank, r.endpoint, r.replay_endpoint) for r in got.ranks] == [
        (0, "tcp://10.0.0.7:5557", None),
        (1, "tcp://10.0.0.7:5558", None),
    ]
    assert (
        parse_kv_event_sources({"0": rank}, "fd00::7", 16, keys).ranks[0].endpoint == "tcp://[fd00::7]:5557"
    )
    assert parse_kv_event_sources({}, "10.0.0.7", 16, keys) is None
    for bad in (
        {"01": rank},  # not as vLLM writes a rank (and "1" would be the same rank)
        {"\u0661": rank},  # a digit, but not an ASCII one
        {"256": rank},
        {"0": "tcp://*:5557"},
        {"0": rank | {"endpoint": "ipc:///tmp/router-own-socket"}},
        [rank],
        {str(i): rank for i in range(257)},
    ):
        with pytest.raises(ValueError):
            parse_kv_event_sources(bad, "10.0.0.7", 16, keys)


def test_a_pod_with_a_wrong_shaped_kv_events_reply_still_leaves_when_its_health_turns_503(
    tmp_path: Path, pod: HostilePod
) -> None:
    pod.kv_events_reply = [{"endpoint": 5}]  # a list where an object belongs
    router = router_for(tmp_path, pod, synced=False)
    try:
        status, _ = post(router, "/v1/completions", COMPLETION)
        assert status == 200  # routed by load meanwhile
        pod.health_status = 503
        wait_for(lambda: not router.pod(pod.name)["ready"], 30, "the pod to leave the routing")
        status, body = post(router, "/v1/completions", COMPLETION)
        assert status == 503 and json.loads(body)["error"]["code"] == "no_ready_pod", body
        assert "GET /kv_events is unusable" in router.log()
    finally:
        stop_router(router)  # and no traceback in its log


def test_a_pod_that_turns_unready_loses_its_entries_until_it_is_back(tmp_path: Path, pod: HostilePod) -> None:
    """Its event sockets still up (a node cut off, a process whose HTTP side died): the probe decides."""
    for _ in range(2):
        pod.record(stored_keys(random_keys(3)))
    router = router_for(tmp_path, pod)
    try:
        wait_for(lambda: router.pod(pod.name)["indexed_blocks"] == 6, 30, "the pod's blocks indexed")
        pod.health_status = 503
        wait_for(lambda: router.pod(pod.name)["indexed_blocks"] == 0, 30, "its entries dropped")
        time.sleep(3)  # a few idle checks of its stream (1 s each): none may rebuild them from replay
        assert router.pod(pod.name)["indexed_blocks"] == 0 and not router.pod(pod.name)["ready"]
        pod.health_status = 200
        wait_for(lambda: router.pod(pod.name)["indexed_blocks"] == 6, 30, "its entries rebuilt from replay")
    finally:
        stop_router(router)


# ---- a router starting: it listens once its pods are probed ------------------------------------------
def test_a_starting_router_listens_only_once_its_pods_are_probed(tmp_path: Path, pod: HostilePod) -> None:
    """A router restarted under load used to answer its first requests 503 no_ready_pod with every pod up:
    it listened before its first probes came back. A slow /health (1.5 s) makes that window certain."""
    pod.health_delay_s = 1.5
    router = start_router(tmp_path, [pod.url], "--policy", "round-robin", no_pod=True)
    try:
        assert router.pod(pod.name)["ready"], router.health()  # the first /health it answers
        status, body = post(router, "/v1/completions", COMPLETION)
        assert status == 200, body
    finally:
        stop_router(router)


# ---- proxied requests: a read timeout and a byte cap ------------------------------------------------
def test_a_silent_pod_gets_the_client_a_504(tmp_path: Path, pod: HostilePod) -> None:
    router = router_for(tmp_path, pod, "--proxy-timeout", "2")
    try:
        pod.completion = "silent"
        status, body = post(router, "/v1/completions", COMPLETION, timeout=60)
        error = json.loads(body)["error"]
        assert status == 504 and error["code"] == "upstream_timeout", body
        assert set(error) == {"message", "type", "param", "code"}
        # ...and mid-stream: the chunk sent, then an error event, then the end of the stream
        pod.health_status = 200
        wait_for(lambda: router.pod(pod.name)["ready"], 30, "the pod back after its probe")
        pod.completion = "stream_then_silent"
        status, body = post(router, "/v1/completions", {**COMPLETION, "stream": True}, timeout=60)
        events = [line for line in body.decode().split("\n\n") if line]
        assert status == 200 and events[0].startswith('data: {"choices"'), body
        assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "upstream_timeout", body
    finally:
        stop_router(router)


def test_non_streamed_requests_ride_one_kept_alive_connection_to_the_pod(
    tmp_path: Path, pod: HostilePod
) -> None:
    """Sent one after the other, ten completions reach the pod on one connection (the router's pool,
    router/proxy.py), and a stream on one of its own (aiohttp's client), however its body spells
    "stream"; a body with an escape that spells something else stays on the pool."""
    router = router_for(tmp_path, pod)
    try:
        del pod.completion_ports[:]
        for _ in range(10):
            status, body = post(router, "/v1/completions", COMPLETION)
            assert status == 200 and json.loads(body)["object"] == "text_completion", body[:200]
        assert len(pod.completion_ports) == 10 and len(set(pod.completion_ports)) == 1, pod.completion_ports
        pod.completion, pod.flood_events, pod.huge_bytes = "stream_flood", 2, 1
        status, body = post(router, "/v1/completions", COMPLETION | {"stream": True})
        assert status == 200 and body.endswith(b"data: [DONE]\n\n"), body[:200]
        assert len(pod.completion_ports) == 11 and pod.completion_ports[-1] != pod.completion_ports[0]
        # The pool reads a reply whole: a stream sent there would reach the client at its end, and one
        # longer than --max-reply-bytes never.
        escaped = b'{"model": "m", "prompt": "hi", "max_tokens": 4, "\\u0073tream": true}'
        status, body = post(router, "/v1/completions", escaped)
        assert status == 200 and body.endswith(b"data: [DONE]\n\n"), body[:200]
        assert len(pod.completion_ports) == 12 and pod.completion_ports[-1] != pod.completion_ports[0]
        pod.completion = "ok"
        status, body = post(
            router, "/v1/completions", b'{"model": "m", "prompt": "caf\\u00e9", "max_tokens": 4}'
        )
        assert status == 200 and pod.completion_ports[-1] == pod.completion_ports[0], pod.completion_ports
    finally:
        stop_router(router)


@pytest.mark.parametrize(
    "body, may",
    [
        (b'{"stream": true}', True),
        (b'{"\\u0073tream": true}', True),
        (b'{"s\\u0074re\\u0061\\u006D": false}', True),  # any letter, either case of hex
        (b'{"prompt": "caf\\u00e9", "max_tokens": 4}', False),
        (b'{"prompt": "\\u0073tream"}', True),  # in a value: only the slower path, never the wrong one
        (b'{"\\u0053tream": true}', False),  # "Stream": not the key
        (b'{"streams": true}', False),
    ],
)
def test_a_body_that_might_stream_is_told_by_its_bytes(body: bytes, may: bool) -> None:
    assert _may_stream(body) is may


def test_a_non_streamed_reply_is_capped(tmp_path: Path, pod: HostilePod) -> None:
    router = router_for(tmp_path, pod, "--max-reply-bytes", "1000000")
    try:
        pod.completion, pod.huge_bytes = "huge", 999_000
        assert post(router, "/v1/completions", COMPLETION)[0] == 200
        wait_for(lambda: router.pod(pod.name)["ready"], 30, "the pod ready")
        pod.huge_bytes = 5_000_000
        status, body = post(router, "/v1/completions", COMPLETION)
        assert status == 502 and json.loads(body)["error"]["code"] == "reply_too_large", body[:200]
        # Compressed although the router asked for none: the client gets it inflated, as it was sent.
        wait_for(lambda: router.pod(pod.name)["ready"], 30, "the pod ready")
        pod.completion, pod.huge_bytes = "huge_gzip", 2000
        status, body = post(router, "/v1/completions", COMPLETION)
        assert status == 200 and json.loads(body) == {"pad": "x" * 2000}, body[:200]
        # Its Content-Length is small: what it inflates to is what counts.
        pod.huge_bytes = 5_000_000
        status, body = post(router, "/v1/completions", COMPLETION)
        assert status == 502 and json.loads(body)["error"]["code"] == "reply_too_large", body[:200]
    finally:
        stop_router(router)


# ---- a daemon killed while the router streams from it -----------------------------------------------
def test_a_daemon_killed_mid_stream_ends_the_stream_cleanly_and_leaves(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path)
    router = None
    name = f"127.0.0.1:{daemon.port}"
    try:
        router = start_router(tmp_path, [daemon.url], "--policy", "round-robin")
        prompt = "Count slowly, one number a line, from one up to forty: one, two, three, four, five, six,"
        r = router.request("POST", "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert r.status == 200, r.body
        wait_for(lambda: router.pod(name)["indexed_blocks"] > 0, 30, "the pod's blocks indexed")
        sock = send_completion(router.port, max_tokens=400, stream=True)
        received = read_until_decoding(sock)
        daemon.proc.kill()
        # Chunked on the wire: the error event, then the last (empty) chunk that ends the stream (the
        # connection itself stays open: keep-alive).
        while not received.endswith(b"\r\n0\r\n\r\n"):
            chunk = sock.recv(65536)
            assert chunk, received[-500:]
            received += chunk
        sock.close()
        _, _, rest = received.partition(b'data: {"error"')
        assert rest, received[-500:]
        error = json.loads(b'{"error"' + rest.split(b"\n\n")[0])["error"]
        assert error["code"] == "bad_gateway" and name in error["message"], error
        wait_for(
            lambda: (p := router.pod(name)) and not p["ready"] and p["indexed_blocks"] == 0,
            15,
            "the router to drop the pod and its entries",
        )
    finally:
        stop_fleet(router, [daemon])


# ---- a fast stream to a slow client ---------------------------------------------------------------------
def test_a_stream_faster_than_its_client_arrives_whole_and_in_order(tmp_path: Path, pod: HostilePod) -> None:
    """The client reads nothing for a while, then slowly: the router stops relaying straight to it once
    it is behind, and catches up through aiohttp's draining writes, losing and reordering nothing."""
    router = router_for(tmp_path, pod)
    try:
        pod.completion, pod.flood_events, pod.huge_bytes = "stream_flood", 4000, 1000  # ~4 MB
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=60)
        conn.connect()
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        body = json.dumps({**COMPLETION, "stream": True}).encode()
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        time.sleep(2)  # the pod has sent it all by now; the router holds what the client has not read
        resp = conn.getresponse()
        events = []
        while piece := resp.read(16384):
            events.append(piece)
            time.sleep(0.001)
        conn.close()
        events = b"".join(events).split(b"\n\n")
        assert resp.status == 200 and events[-2:] == [b"data: [DONE]", b""], events[-3:]
        numbers = [json.loads(e.removeprefix(b"data: "))["n"] for e in events[:-2]]
        assert numbers == list(range(4000)), numbers[:10]
    finally:
        stop_router(router)
