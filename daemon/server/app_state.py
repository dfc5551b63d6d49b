"""What the daemon's routes share: settings (settings.py), the engine, its loop, metrics, the drain state."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvpilot.daemon.engine.dp_engine import DataParallelLoop
from kvpilot.daemon.engine.engine_loop import EngineDeadError, EngineLoop
from kvpilot.daemon.server.metrics import DaemonMetrics
from kvpilot.daemon.server.settings import ServerSettings
from kvpilot.daemon.server.text_pool import TextPool

# No token of a vocabulary decodes to more characters than its longest entry; 4x covers normalizers
# that shrink text before splitting it (NFKC and friends).
CHARS_PER_TOKEN_MARGIN = 4


@dataclass(slots=True)
class ServerState:
    engine: Any
    settings: ServerSettings
    served: list[str]
    metrics: DaemonMetrics
    text: TextPool
    max_prompt_chars: int  # longer prompt texts cannot fit the context, whatever their tokens
    loop: EngineLoop | DataParallelLoop | None = None
    draining: bool = False
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    created: int = field(default_factory=lambda: int(time.time()))


STATE = web.AppKey("kvpilot_state", ServerState)


def running_loop(state: ServerState) -> EngineLoop | DataParallelLoop:
    if state.loop is None or not state.loop.alive:
        raise EngineDeadError("the engine loop is not running")
    return state.loop


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return CHARS_PER_TOKEN_MARGIN * max(longest, 1) * max_model_len
