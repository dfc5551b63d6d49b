"""What the daemon's routes share: settings, the engine, its loop, metrics, the drain state."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvpilot.daemon.engine.engine_loop import EngineDeadError, EngineLoop
from kvpilot.daemon.server.metrics import DaemonMetrics


@dataclass(slots=True)
class ServerSettings:
    host: str = "0.0.0.0"
    port: int = 8000
    served_model_names: list[str] = field(default_factory=list)  # empty: the engine's model name
    admin_token: str | None = None
    max_body_bytes: int = 4 << 20  # a full 128k-token context as JSON fits well below this
    shutdown_timeout: float = 30.0  # SIGTERM grace period for in-flight requests


@dataclass(slots=True)
class ServerState:
    engine: Any
    settings: ServerSettings
    served: list[str]
    metrics: DaemonMetrics
    loop: EngineLoop | None = None
    draining: bool = False
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    created: int = field(default_factory=lambda: int(time.time()))


STATE = web.AppKey("kvpilot_state", ServerState)


def running_loop(state: ServerState) -> EngineLoop:
    if state.loop is None or not state.loop.alive:
        raise EngineDeadError("the engine loop is not running")
    return state.loop
