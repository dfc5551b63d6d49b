"""What the daemon's routes share: settings (settings.py), the engine client, metrics, the text pool, the drain
state."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

from aiohttp import web

from kvpilot.daemon.engine.client import EngineClient, EngineDeadError
from kvpilot.daemon.engine.weights.lora import ServedAdapter
from kvpilot.daemon.kv_transfer.server import TransferServer
from kvpilot.daemon.server.choices import TokenTexts
from kvpilot.daemon.server.metrics import DaemonMetrics
from kvpilot.daemon.server.prepare import PromptRules
from kvpilot.daemon.server.settings import ServerSettings
from kvpilot.serving.text_pool import TextPool


@dataclass(slots=True)
class WeightStatus:
    """The served weights as the routes last saw them (for /health, /v1/models, /prefix_cache; each
    generated token carries its own version, from the engine)."""

    version: str = "initial"
    digest: str | None = None
    paused: str | None = None  # the pause mode while paused


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
    weights: WeightStatus = field(default_factory=WeightStatus)
    adapters: dict[str, ServedAdapter] = field(default_factory=dict)  # the LoRA adapters served, by name
    transfer_server: TransferServer | None = None  # a KV producer's pull server (kv_transfer/server.py)
    transfer_key: bytes | None = None  # what prefill replies are signed with (server/disagg.py transfer_key)
    lora_lock: asyncio.Lock = field(
        default_factory=asyncio.Lock
    )  # weights/lora_routes.py's loads and unloads

    def set_adapter(self, name: str, adapter: ServedAdapter | None) -> None:
        """Serve `adapter` as `name` (None: stop serving it): /v1/models, /health and every request
        parsed from now on see it."""
        if adapter is None:
            self.adapters.pop(name, None)
        else:
            self.adapters[name] = adapter
        self.rules = dataclasses.replace(self.rules, adapters=frozenset(self.adapters))


STATE = web.AppKey("kvpilot_state", ServerState)


def running_engine(state: ServerState) -> EngineClient:
    if not state.engine.alive:
        raise EngineDeadError(state.engine.error or "the engine is not running")
    return state.engine
