"""An in-process engine that publishes KV events (PUB and replay on free loopback ports): the KV event and
privacy tests' publisher; reading its batches back through its replay socket; and the fleet's CURVE key
files, as the operator's Secret holds them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.kv import sockets as kv_sockets
from kvpilot.router.kv.replay import fetch_replay

BS = 16  # tokens per block of these engines


def kv_events_engine(model: Path, **config: Any) -> LLMEngine:
    """A small engine (12 blocks of 16 tokens, 160-token context) on `model`; `config` adds EngineConfig fields."""
    return LLMEngine(
        EngineConfig(
            model=str(model),
            num_kv_blocks=12,
            block_size=BS,
            max_model_len=160,
            kv_events_endpoint="tcp://127.0.0.1:*",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
            **config,
        )
    )


def write_fleet_keys(folder: Path) -> None:
    """`folder` with a server and a client key pair, the files the operator's Secret holds."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in (kv_sockets.SERVER, kv_sockets.CLIENT):
        for file, text in kv_sockets.key_files(name).items():
            (folder / file).write_text(text)


def replay_all(endpoint: str, start: int = 0) -> list[tuple[int, bytes]]:
    async def go() -> list[tuple[int, bytes]] | None:
        ctx = zmq.asyncio.Context()
        try:
            return await fetch_replay(ctx, endpoint, start)
        finally:
            ctx.term()

    got = asyncio.run(go())
    assert got is not None, "the replay socket did not answer"
    return got


def wait_replayed(endpoint: str, n: int) -> list[tuple[int, bytes]]:
    """The publisher thread sends asynchronously: wait until it has buffered `n` batches."""
    deadline = time.monotonic() + 10
    while len(got := replay_all(endpoint)) < n:
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    return got
