"""What the router's handlers share (settings, fleet, index, policy, prompt reader, metrics, the client
session), held by the aiohttp app under one key."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from kvpilot.router.fleet.pods import Fleet
from kvpilot.router.kv.index import PrefixIndex
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.routing.policy import Policy
from kvpilot.router.routing.prompts import MIN_PARSE_LIMIT, PromptReader
from kvpilot.router.settings import RouterSettings


@dataclass(slots=True)
class Router:
    settings: RouterSettings
    fleet: Fleet
    index: PrefixIndex
    policy: Policy
    reader: PromptReader | None
    metrics: RouterMetrics
    session: aiohttp.ClientSession
    proxy_timeout: aiohttp.ClientTimeout = field(init=False)  # of every proxied request: made once

    def __post_init__(self) -> None:
        self.proxy_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=5, sock_read=self.settings.proxy_timeout_s
        )

    @property
    def parse_limit(self) -> int:
        """The biggest request body the router parses (prompts.py says why there is one)."""
        return self.reader.parse_limit if self.reader is not None else MIN_PARSE_LIMIT


ROUTER = web.AppKey("kvpilot_router", Router)
