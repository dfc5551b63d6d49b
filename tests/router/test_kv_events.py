"""KV events from a real engine: vLLM's wire layout, the same keys the router computes, replay."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import zmq
import zmq.asyncio

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.request import SamplingParams
from kvpilot.kv.block_keys import key_scheme
from kvpilot.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from kvpilot.router.kv.index import PrefixIndex
from kvpilot.router.kv.replay import ReplayChannel, ReplayError, ReplayLimits
from kvpilot.router.kv.stream import PodEventStream
from support.kv_events import BS, kv_events_engine, replay_all, wait_replayed

pytestmark = pytest.mark.timeout(300)

POD = ("pod", 0)  # the index entry of a stream: (pod, rank)
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine(tiny_model_dir):  # noqa: ANN001, ANN201
    eng = kv_events_engine(tiny_model_dir)
    yield eng
    eng.close()


def test_off_by_default_records_nothing(tiny_model_dir) -> None:  # noqa: ANN001
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=8))
    assert eng.kv_events is None and eng.kv.pool.events is None
    eng.generate([list(range(10, 50))], GREEDY)


def test_stored_removed_cleared_on_the_wire_and_replayed(engine: LLMEngine) -> None:
    pub = engine.kv_events
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks
    salt = "tenant-a"
    engine.generate([prompt], GREEDY, cache_salt=salt)
    first = wait_replayed(pub.replay_endpoint, 1)
    # vLLM's layout: [ts, events, data_parallel_rank], events as maps tagged by "type"
    raw = msgpack.unpackb(first[0][1], raw=False)
    assert isinstance(raw[0], float) and raw[2] == 0
    assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["block_size"] == BS
    assert raw[1][0]["token_ids"] == []  # token_ids: vLLM's field, empty without --kv-events-token-ids
    batch = decode_batch(first[0][1])
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert len(stored) == 1, batch  # consecutive blocks of one chain travel together
    expected = key_scheme().prompt_hashes(prompt, BS, salt)  # the router's computation: the same keys
    assert stored[0].block_hashes == expected
    assert stored[0].parent_block_hash is None
    assert stored[0].token_ids == []

    # A pool of 12 blocks: five more distinct prompts of 3 full blocks each evict older cached blocks.
    for k in range(5):
        engine.generate([list(range(1000 + 100 * k, 1000 + 100 * k + 50))], GREEDY)
    result = engine.reset_prefix_cache()
    assert result.success
    got = wait_replayed(pub.replay_endpoint, 7)
    seqs = [s for s, _ in got]
    assert seqs == list(range(len(seqs))), seqs  # monotonic, no gaps
    events = [e for _, p in got for e in decode_batch(p).events]
    assert any(isinstance(e, BlockRemoved) for e in events), events
    assert isinstance(events[-1], AllBlocksCleared)

    # Applying the stream in order gives the engine's own index: empty after the reset.
    index = PrefixIndex()
    for _, p in got:
        index.apply("pod", decode_batch(p))
    assert index.num_blocks("pod") == 0 and index.clears("pod") == 1
    # ...and before the reset, exactly the blocks the engine had indexed.
    index = PrefixIndex()
    for _, p in got[:-1]:
        index.apply("pod", decode_batch(p))
    assert index.num_blocks("pod") == result.evicted_blocks
    # replay from the middle returns only the tail
    assert [s for s, _ in replay_all(pub.replay_endpoint, start=2)] == seqs[2:]


def test_a_replay_channel_keeps_its_connection_and_starts_a_new_one_after_a_refused_answer(
    engine: LLMEngine,
) -> None:
    pub = engine.kv_events
    for i in range(3):
        engine.generate([list(range(200 + 40 * i, 240 + 40 * i))], GREEDY)
    seqs = [s for s, _ in wait_replayed(pub.replay_endpoint, 3)]
    last = seqs[-1]

    async def go() -> None:
        ctx = zmq.asyncio.Context()
        channel = ReplayChannel(ctx, pub.replay_endpoint, ReplayLimits(batches=1))
        try:
            assert [s for s, _ in await channel.fetch(last)] == [last]
            connection = channel._owned
            assert [s for s, _ in await channel.fetch(last)] == [last]
            assert channel._owned is connection  # asked again on the open connection
            with pytest.raises(ReplayError, match="more than its buffer"):
                await channel.fetch(0)  # 3 batches against a limit of 1: refused midway
            assert channel._owned is None  # the rest of that answer is never read
            # A new connection: its answer is this request's, not the refused one's tail.
            assert [s for s, _ in await channel.fetch(last)] == [last]
            assert await channel.fetch(last + 1) == []
        finally:
            channel.close()
            ctx.term()

    asyncio.run(go())


def test_a_consumer_that_drops_messages_recovers_through_replay(engine: LLMEngine) -> None:
    """The consumer reads the live PUB stream but loses two batches; replay fills the hole, and its
    index ends equal to one built from the complete stream."""
    pub = engine.kv_events

    async def go() -> tuple[PrefixIndex, dict]:
        ctx = zmq.asyncio.Context()
        counts: dict[str, int] = {}

        def count(pod: str, result: str, n: int) -> None:
            counts[result] = counts.get(result, 0) + n

        index = PrefixIndex()
        stream = PodEventStream("pod", pub.endpoint, pub.replay_endpoint, index, count, ctx)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        await asyncio.sleep(0.3)  # let the subscription reach the publisher
        loop = asyncio.get_running_loop()
        prompts = [list(range(200 + 60 * k, 200 + 60 * k + 40)) for k in range(5)]
        work = loop.run_in_executor(None, lambda: [engine.generate([p], GREEDY) for p in prompts])
        received = 0
        while received < 5:
            frames = await asyncio.wait_for(sub.recv_multipart(), 30)
            seq = int.from_bytes(frames[1], "big", signed=True)
            received += 1
            if seq in (1, 2):
                continue  # dropped by this consumer
            await stream.on_message(seq, frames[2])
        await work
        sub.close(linger=0)
        ctx.term()
        return index, counts

    index, counts = asyncio.run(go())
    complete = PrefixIndex()
    for _, p in replay_all(pub.replay_endpoint):
        complete.apply(POD, decode_batch(p))
    assert counts.get("replayed") == 2 and not counts.get("missed"), counts
    assert index.num_blocks(POD) == complete.num_blocks(POD) == len(engine.kv.pool.indexed_keys())
    keys = [
        k
        for p in range(5)
        for k in key_scheme().prompt_hashes(list(range(200 + 60 * p, 200 + 60 * p + 40)), BS)
    ]
    assert index.matched_blocks(keys[-2:], [POD]) == complete.matched_blocks(keys[-2:], [POD])


def test_kv_events_route_names_the_sockets_and_is_404_when_off(tiny_model_dir) -> None:  # noqa: ANN001
    import aiohttp
    from aiohttp import web

    from kvpilot.daemon.engine.engine_loop import EngineLoop
    from kvpilot.daemon.server.app import create_app

    async def get(engine: LLMEngine) -> tuple[int, dict]:
        runner = web.AppRunner(create_app(EngineLoop(engine)))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/kv_events") as r:
                return r.status, await r.json()
        finally:
            await runner.cleanup()

    off = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=8))
    status, body = asyncio.run(get(off))
    assert status == 404 and "--kv-events-endpoint" in body["error"]["message"]
    on = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=8, kv_events_endpoint="tcp://0.0.0.0:*")
    )
    status, body = asyncio.run(get(on))  # the app's cleanup closes the publisher
    assert status == 200, body
    port = on.kv_events.endpoint.rsplit(":", 1)[1]
    # a wildcard bind is named by the address the client reached
    assert body["endpoint"] == f"tcp://127.0.0.1:{port}" and body["replay_endpoint"] is None
    assert body["block_size"] == 16 and body["ranks"][0]["rank"] == 0


def test_a_restarted_publisher_is_followed_from_its_new_start(engine: LLMEngine) -> None:
    """The pod goes away (its connection drops): its entries go; its successor's stream, numbered from 0
    again, is followed."""
    from kvpilot.daemon.engine.kv.publisher import KVEventPublisher

    first = engine.kv_events

    async def until(check, what: str) -> None:  # noqa: ANN001
        deadline = time.monotonic() + 20
        while not check():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.05)

    async def go() -> tuple[PrefixIndex, list]:
        ctx = zmq.asyncio.Context()
        index = PrefixIndex()
        stream = PodEventStream("pod", first.endpoint, first.replay_endpoint, index, lambda *a: None, ctx)
        task = asyncio.create_task(stream.run())
        await stream.synced.wait()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, engine.generate, [list(range(300, 340))], GREEDY)
        await until(lambda: index.num_blocks(POD) == 2, "the first publisher's blocks")
        first.close()  # the daemon stops
        await until(lambda: index.num_blocks(POD) == 0, "the pod's entries to go with its connection")
        engine.reset_prefix_cache()  # a restarted daemon starts empty...
        second = KVEventPublisher(first.endpoint, first.replay_endpoint, BS)  # ...and counts from 0 again
        engine.kv_events, engine.kv.pool.events = second, second.recorder
        await loop.run_in_executor(None, engine.generate, [list(range(400, 456))], GREEDY)
        await until(lambda: index.num_blocks(POD) == 3, "the second publisher's blocks")
        keys = key_scheme().prompt_hashes(list(range(400, 448)), BS)
        matched = index.matched_blocks(keys, [POD])[POD]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.term()
        return index, [matched]

    index, (matched,) = asyncio.run(go())
    assert matched == 3 and index.num_blocks(POD) == len(engine.kv.pool.indexed_keys()) == 3
