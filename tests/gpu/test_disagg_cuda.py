"""Disaggregation on CUDA: a prefill engine's hold is gathered into pinned host memory on the side stream (its
event set once landed), served by the real transfer server once that event fires, pulled by the real client and
landed in a decode engine's pool on the GPU: greedy tokens as one engine gives them. The CPU twins:
tests/engine/test_disagg.py and tests/server/test_disagg.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvpilot.daemon.engine.client import EngineRequest
from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.request import SamplingParams
from kvpilot.daemon.kv_transfer.pull import PullRequest, pull
from kvpilot.daemon.kv_transfer.remote import RemoteBlocks
from kvpilot.daemon.kv_transfer.server import TransferServer

pytestmark = pytest.mark.gpu

PROMPT = list(range(1000, 1200))
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


def engine(model_dir, role: str | None) -> LLMEngine:  # noqa: ANN001
    cfg = {"kv_connector": "KvpilotConnector", "kv_role": role} if role else None
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device="cuda",
            dtype="float32",
            num_kv_blocks=256,
            kv_transfer_config=json.dumps(cfg) if cfg else None,
        )
    )


def run(eng: LLMEngine, req: EngineRequest) -> tuple[list[int], object]:
    eng.submit(req)
    tokens, last = [], None
    while eng.has_unfinished_requests():
        for o in eng.step():
            tokens += o.new_token_ids
            last = o
    return tokens, last


def test_a_hold_crosses_pinned_memory_and_the_wire_to_a_cuda_decode(default_model_dir) -> None:  # noqa: ANN001
    alone, _ = run(engine(default_model_dir, None), EngineRequest("a", PROMPT, PARAMS))
    producer, consumer = engine(default_model_dir, "kv_producer"), engine(default_model_dir, "kv_consumer")
    _, last = run(producer, EngineRequest("p", PROMPT, SamplingParams(max_tokens=1), kv_hold="h"))
    keys = list(last.held.keys)
    assert len(keys) == (len(PROMPT) - 1) // 16
    held = producer.connector.held
    assert held._held["h"].data.is_pinned() and held._held["h"].ready is not None
    connector = consumer.connector
    plan = consumer.plan_pull(EngineRequest("d", PROMPT, PARAMS), keys)

    async def transfer():  # noqa: ANN202
        server = TransferServer(held, "127.0.0.1", 0, 30, lambda blocks, nbytes: None)
        port = await server.start()
        try:
            ask = PullRequest("127.0.0.1", port, "h", plan.first, plan.count, last.held.epoch)
            return await pull(ask, connector.block_shape, connector.dtype, 30)
        finally:
            await server.stop()

    data = asyncio.run(transfer())
    remote = RemoteBlocks(plan.first, tuple(keys[plan.first :]), data, plan.generation)
    tokens, out = run(consumer, EngineRequest("d", PROMPT, PARAMS, remote_kv=remote))
    assert tokens == alone
    assert out.num_cached_tokens == len(keys) * 16
