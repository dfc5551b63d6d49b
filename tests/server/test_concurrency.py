"""Many streams while the prefix cache is reset under them: same greedy text, honest replies, no leak."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest

from support.servers import MODEL, Server

pytestmark = pytest.mark.timeout(600)

SYSTEM = "You are a terse assistant. Answer in one short sentence. " * 3
QUESTIONS = ["What is the sun?", "Why is the sky blue?", "What is rain?", "Name a fruit."]


def conversations(n: int) -> list[list[dict]]:
    return [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        for i in range(n)
    ]


async def run_streams(server: Server, n: int, resets: dict | None = None) -> list[str]:
    """n concurrent greedy chat streams; while they run, POST a reset every `resets['every']` seconds."""
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(messages: list[dict]) -> str:
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        return "".join(parts)

    async def resetter(stop: asyncio.Event) -> None:
        path = server.url + "/reset_prefix_cache"
        if resets["running"]:
            path += "?reset_running_requests=true"
        async with aiohttp.ClientSession(headers=server.admin()) as session:
            while not stop.is_set():
                async with session.post(path) as r:
                    resets["replies"].append((r.status, await r.json()))
                try:
                    await asyncio.wait_for(stop.wait(), resets["every"])
                except TimeoutError:
                    pass

    stop = asyncio.Event()
    task = asyncio.create_task(resetter(stop)) if resets is not None else None
    try:
        return await asyncio.gather(*(one(m) for m in conversations(n)))
    finally:
        stop.set()
        if task is not None:
            await task
        await client.close()


def test_32_streams_with_a_reset_every_50ms(quiet: Server) -> None:
    server = quiet
    server.reset()
    reference = asyncio.run(run_streams(server, 32))
    assert all(reference) and len(set(reference)) == len(QUESTIONS)

    server.reset()
    resets = {"every": 0.05, "running": False, "replies": []}
    start = time.monotonic()
    texts = asyncio.run(run_streams(server, 32, resets))
    elapsed = time.monotonic() - start

    assert texts == reference
    replies = resets["replies"]
    assert len(replies) >= min(5, elapsed / 0.05 / 4), (len(replies), elapsed)
    assert all(status == 200 and body["success"] is True for status, body in replies), replies
    epochs = [body["epoch"] for _, body in replies]
    assert epochs == list(range(epochs[0], epochs[0] + len(epochs)))  # one bump per reset, none lost
    assert any(body["in_flight_requests"] > 0 for _, body in replies)  # they really overlapped

    stats = server.cache()
    assert stats["blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_reset_running_requests_recomputes_without_changing_text(quiet: Server) -> None:
    server = quiet
    reference = asyncio.run(run_streams(server, 8))
    resets = {"every": 0.4, "running": True, "replies": []}
    texts = asyncio.run(run_streams(server, 8, resets))
    assert texts == reference
    assert all(status == 200 for status, _ in resets["replies"])
    assert any(body["preempted_requests"] > 0 for _, body in resets["replies"]), resets["replies"]
    assert server.cache()["blocks_used"] == 0
