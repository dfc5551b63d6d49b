"""What the daemon's routes share: settings, the engine client, metrics, the text pool, the drain state."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from aiohttp import web

from kvpilot.daemon.engine.client import EngineClient, EngineDeadError
from kvpilot.daemon.server.choices import TokenTexts
from kvpilot.daemon.server.metrics import DaemonMetrics
from kvpilot.daemon.server.prepare import PromptRules
from kvpilot.daemon.server.text_pool import TextPool


@dataclass(slots=True)
class ServerSettings:
    host: str = "0.0.0.0"
    port: int = 8000
    served_model_names: list[str] = field(default_factory=list)  # empty: the engine's model name
    admin_token: str | None = None
    max_body_bytes: int = 4 << 20  # a full 128k-token context as JSON fits well below this
    shutdown_timeout: float = 30.0  # SIGTERM grace period for in-flight requests
    request_timeout: float | None = None  # a generation not done by then is aborted (504)
    reset_timeout: float = 60.0  # a rank whose reset has not answered by then fails the reset (500)
    text_workers: int = 2  # threads that tokenize, template and detokenize
    max_pending_prepare: int = 64  # requests waiting to be tokenized beyond which new ones get 503


@dataclass(slots=True)
class ServerState:
    engine: EngineClient
    settings: ServerSettings
    served: list[str]
    metrics: DaemonMetrics
    text: TextPool
    rules: PromptRules  # what request bodies are checked and tokenized with
    token_texts: TokenTexts
    draining: bool = False
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    created: int = field(default_factory=lambda: int(time.time()))


STATE = web.AppKey("kvpilot_state", ServerState)


def running_engine(state: ServerState) -> EngineClient:
    if not state.engine.alive:
        raise EngineDeadError(state.engine.error or "the engine is not running")
    return state.engine
