"""An in-process engine that publishes KV events (PUB and replay on free loopback ports): the KV event and
privacy tests' publisher."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine

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
