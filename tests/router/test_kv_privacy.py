"""KV events are private by default: no token ids unless asked for, CURVE on both sockets with the fleet's
keys (a plain or wrongly keyed peer gets nothing; the router with the fleet's keys indexes), and every
socket refuses frames above its bound without dying. Real engine, real ZeroMQ on loopback."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.request import SamplingParams
from kvpilot.kv import sockets as kv_sockets
from kvpilot.kv.block_keys import key_scheme
from kvpilot.kv.events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
    encode_batches,
)
from kvpilot.router.kv.index import PrefixIndex
from kvpilot.router.kv.replay import ReplayError, ReplayLimits, fetch_replay
from kvpilot.router.kv.stream import PodEventStream
from kvpilot.router.settings import RouterSettings
from support.kv_events import BS, kv_events_engine, write_fleet_keys
from support.procs import free_port
from support.servers import MODEL, start_router, start_server, stop_fleet

pytestmark = pytest.mark.timeout(300)

POD = ("pod", 0)
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
PROMPT = list(range(100, 140))  # 2 full blocks


async def _replay(ctx: zmq.asyncio.Context, endpoint: str, wait_s: float) -> list[tuple[int, bytes]] | None:
    """A replay from seq 0, or None when the socket gives no answer within `wait_s`."""
    try:
        return await fetch_replay(ctx, endpoint, 0, ReplayLimits(silence_s=wait_s, total_s=wait_s))
    except ReplayError:
        return None


def first_stored(engine: LLMEngine, ctx: zmq.asyncio.Context) -> BlockStored:
    """Generate PROMPT and read its BlockStored back through the replay socket."""
    engine.generate([PROMPT], GREEDY)

    async def go() -> list[tuple[int, bytes]]:
        deadline = time.monotonic() + 20
        while True:
            got = await _replay(ctx, engine.kv_events.replay_endpoint, 2.0)
            if got:
                return got
            assert time.monotonic() < deadline, "nothing was published"
            await asyncio.sleep(0.05)

    got = asyncio.run(go())
    return next(e for e in decode_batch(got[0][1]).events if isinstance(e, BlockStored))


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """The fleet's keys, as the operator's Secret holds them: server and client pairs."""
    write_fleet_keys(tmp_path / "fleet")
    return tmp_path / "fleet"


def test_token_ids_only_with_the_flag(tiny_model_dir: Path) -> None:
    for with_ids in (False, True):
        engine = kv_events_engine(tiny_model_dir, kv_events_token_ids=with_ids)
        ctx = zmq.asyncio.Context()
        try:
            stored = first_stored(engine, ctx)
        finally:
            ctx.term()
            engine.close()
        assert stored.block_hashes == key_scheme().prompt_hashes(PROMPT, BS)
        assert stored.token_ids == (PROMPT[: 2 * BS] if with_ids else [])


async def _received_anything(sock: zmq.asyncio.Socket, seconds: float) -> bool:
    return bool(await sock.poll(int(seconds * 1000)))


def test_curve_lets_only_the_fleets_router_in(tiny_model_dir: Path, keys: Path, tmp_path: Path) -> None:
    engine = kv_events_engine(tiny_model_dir, kv_events_curve_dir=str(keys))
    pub = engine.kv_events
    # A stranger's key pair: a valid CURVE client that knows the server's public key, but is not listed.
    stranger = tmp_path / "stranger"
    write_fleet_keys(stranger)
    (stranger / "server.key").write_text((keys / "server.key").read_text())

    async def go() -> tuple[bool, bool, bool, list | None, list | None, PrefixIndex]:
        plain = zmq.asyncio.Context()
        wrong = kv_sockets.subscriber_context(str(stranger))
        fleet = kv_sockets.subscriber_context(str(keys))
        socks = []
        for ctx in (plain, wrong):
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.setsockopt(zmq.LINGER, 0)
            s.connect(pub.endpoint)
            socks.append(s)
        index = PrefixIndex()
        stream = PodEventStream("pod", pub.endpoint, pub.replay_endpoint, index, lambda *a: None, fleet)
        task = asyncio.create_task(stream.run())
        await asyncio.wait_for(stream.synced.wait(), 30)
        await asyncio.sleep(0.5)  # every subscriber has had time to connect (or be refused)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, engine.generate, [PROMPT], GREEDY)
        deadline = time.monotonic() + 30
        while index.num_blocks(POD) < 2:
            assert time.monotonic() < deadline, "the router with the fleet's keys indexed nothing"
            await asyncio.sleep(0.05)
        heard = [await _received_anything(s, 1.0) for s in socks]
        # Replay: the plain and the stranger's DEALER get no answer; the fleet's does.
        replays = [await _replay(ctx, pub.replay_endpoint, 1.0) for ctx in (plain, wrong)]
        ours = await _replay(fleet, pub.replay_endpoint, 10.0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for s in socks:
            s.close()
        for ctx in (plain, wrong, fleet):
            ctx.term()
        return heard[0], heard[1], bool(ours), replays[0], replays[1], index

    try:
        plain_heard, wrong_heard, ours, plain_replay, wrong_replay, index = asyncio.run(go())
    finally:
        engine.close()
    assert not plain_heard and not wrong_heard
    assert plain_replay is None and wrong_replay is None
    assert ours
    assert index.matched_blocks(key_scheme().prompt_hashes(PROMPT, BS), [POD])[POD] == 2


def test_a_router_without_keys_gets_nothing_from_a_curve_daemon(tiny_model_dir: Path, keys: Path) -> None:
    """The router as deployed without --kv-events-curve-dir: its replay gets no answer, nothing is indexed."""
    engine = kv_events_engine(tiny_model_dir, kv_events_curve_dir=str(keys))
    pub = engine.kv_events

    async def go() -> int:
        ctx = kv_sockets.subscriber_context(None)
        index = PrefixIndex()
        stream = PodEventStream("pod", pub.endpoint, pub.replay_endpoint, index, lambda *a: None, ctx)
        task = asyncio.create_task(stream.run())
        await asyncio.sleep(0.5)
        await asyncio.get_running_loop().run_in_executor(None, engine.generate, [PROMPT], GREEDY)
        await asyncio.sleep(3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.term()
        return index.num_blocks(POD)

    try:
        blocks = asyncio.run(go())
    finally:
        engine.close()
    assert blocks == 0


def test_router_drops_an_oversized_frame_and_keeps_following() -> None:
    """A pod that publishes a frame above the router's bound is disconnected before the frame is buffered;
    the stream connects again, counts the batch as missed and indexes the next ones."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    # 40000 x 34 bytes: over the bound; distinct digests (the index keeps a key by its leading 16 bytes)
    key = [hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(40_000)]

    def send(seq: int, keys: list[bytes]) -> None:
        payload = encode_batch(EventBatch(time.time(), [BlockStored(keys, None, [], BS)]))
        pub.send_multipart([b"", seq.to_bytes(8, "big", signed=True), payload])

    async def go() -> tuple[PrefixIndex, dict]:
        counts: dict[str, int] = {}

        def count(pod: str, result: str, n: int) -> None:
            counts[result] = counts.get(result, 0) + n

        sctx = kv_sockets.subscriber_context(None)
        index = PrefixIndex()
        stream = PodEventStream("pod", endpoint, None, index, count, sctx, idle_check_s=0.2)
        task = asyncio.create_task(stream.run())

        async def until(keys: list[bytes], seq: int, what: str) -> None:
            deadline = time.monotonic() + 60
            while not index.matched_blocks(keys, [POD]).get(POD):
                assert time.monotonic() < deadline, what
                send(seq, keys)  # again until it arrives: a resent batch is applied once
                await asyncio.sleep(0.1)

        await until(key[:1], 0, "the first batch")
        send(1, key)
        await until(key[1:2], 2, "a batch after the oversized one")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        sctx.term()
        return index, counts

    try:
        index, counts = asyncio.run(go())
    finally:
        pub.close(0)
        ctx.term()
    assert index.num_blocks(POD) == 1 and counts.get("missed", 0) >= 1, counts


def test_replay_socket_drops_an_oversized_request_and_keeps_serving(tiny_model_dir: Path) -> None:
    engine = kv_events_engine(tiny_model_dir)
    pub = engine.kv_events
    engine.generate([PROMPT], GREEDY)
    ctx = zmq.Context()
    try:
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        bad.connect(pub.replay_endpoint)
        bad.send_multipart([b"", b"\0" * (kv_sockets.PUBLISHER_MAXMSGSIZE + 1)])
        assert not bad.poll(1000)  # no answer to it
        bad.close()

        async def replay() -> list | None:
            actx = zmq.asyncio.Context()
            try:
                return await _replay(actx, pub.replay_endpoint, 10.0)
            finally:
                actx.term()

        deadline = time.monotonic() + 20
        while not (got := asyncio.run(replay())):
            assert time.monotonic() < deadline, "the replay socket stopped serving"
            time.sleep(0.1)
    finally:
        ctx.term()
        engine.close()
    assert isinstance(decode_batch(got[0][1]).events[0], BlockStored)


def test_a_big_step_is_split_into_messages_that_fit() -> None:
    small = EventBatch(1.5, [BlockRemoved([b"k" * 32])], 3)
    assert encode_batches(small) == [encode_batch(small)]  # the usual case: vLLM's one message per step
    hashes = [i.to_bytes(32, "big") for i in range(20_000)]
    events = [
        BlockStored(hashes[i : i + 1000], None, list(range(1000 * 16)), 16) for i in range(0, 20_000, 1000)
    ]
    big = EventBatch(2.0, [*events, BlockRemoved(hashes[:1000])], 0)
    payloads = encode_batches(big)
    assert len(payloads) > 1 and all(len(p) <= kv_sockets.MAX_BATCH_BYTES for p in payloads)
    decoded = [decode_batch(p) for p in payloads]
    assert [e for b in decoded for e in b.events] == big.events
    assert {(b.ts, b.data_parallel_rank) for b in decoded} == {(2.0, 0)}
    assert msgpack.unpackb(payloads[0])[0] == 2.0


def test_missing_keys_are_a_startup_error(tmp_path: Path, keys: Path) -> None:
    with pytest.raises(ValueError, match="client.key_secret"):
        RouterSettings(kv_events_curve_dir=str(tmp_path)).validate()
    with pytest.raises(ValueError, match="server.key_secret"):
        EngineConfig(kv_events_curve_dir=str(tmp_path)).validate()
    (keys / "client.key").unlink()
    with pytest.raises(ValueError, match="names no client"):
        kv_sockets.load_server_keys(keys)


def test_serve_and_router_processes_with_the_fleets_keys(tmp_path: Path, keys: Path) -> None:
    """`kvpilot serve` and `kvpilot router`, both with --kv-events-curve-dir: the router indexes what the
    daemon caches. Without keys (or with keys that are not there) neither starts."""
    for command in (["serve"], ["router", "--endpoints", "http://127.0.0.1:9"]):
        r = subprocess.run(
            [sys.executable, "-m", "kvpilot", *command, "--kv-events-curve-dir", str(tmp_path / "none")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and "key_secret" in r.stderr, r.stderr[-2000:]
    daemon = start_server(
        tmp_path,
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{free_port()}",
        "--kv-events-replay-endpoint",
        f"tcp://127.0.0.1:{free_port()}",
        "--kv-events-curve-dir",
        str(keys),
        token=None,
    )
    router = None
    try:
        router = start_router(tmp_path, [daemon.url], "--kv-events-curve-dir", str(keys), token=None)
        prompt = "A prompt long enough to fill a few KV blocks. " * 8
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        assert router.request("POST", "/v1/completions", body).status == 200
        name = f"127.0.0.1:{daemon.port}"
        deadline = time.monotonic() + 30
        while router.pod(name)["indexed_blocks"] == 0:
            assert time.monotonic() < deadline, router.health()
            time.sleep(0.2)
    finally:
        stop_fleet(router, [daemon])
