"""What the router's handlers share (settings, fleet, index, policies, prompt reader, metrics, the client
session and the pods' connection pool), held by the aiohttp app under one key."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from kvpilot.fanout.http1 import Pool
from kvpilot.router.fleet.pods import Fleet
from kvpilot.router.kv.index import PrefixIndex
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.routing.policy import Policy
from kvpilot.router.routing.prompts import MIN_PARSE_LIMIT, PromptReader
from kvpilot.router.settings import RouterSettings
from kvpilot.serving.http_limits import UPSTREAM_IDLE_S

CONNECT_S = 5.0  # a pod that has not taken the connection by then is unreachable: the next pod is tried


def _pod_pool() -> Pool:
    """Keep-alive connections to the pods for non-streamed requests (router/proxy.py): as many idle per pod
    as were in flight to it, each kept under a pod's header timeout (UPSTREAM_IDLE_S)."""
    return Pool(max_idle=4096, idle_s=UPSTREAM_IDLE_S, per_key=1024, connect_s=CONNECT_S)


@dataclass(slots=True)
class Router:
    settings: RouterSettings
    fleet: Fleet
    index: PrefixIndex
    policy: Policy
    reader: PromptReader | None
    metrics: RouterMetrics
    session: aiohttp.ClientSession
    # While the fleet is disaggregated (its pods have roles): the decode pool's own instance of the policy
    # (its own tie-break turn); `policy` picks among the prefill pool. Made whatever the fleet is now: a
    # --fleet router's pods may take roles at any list.
    decode_policy: Policy
    pool: Pool = field(default_factory=_pod_pool)
    proxy_timeout: aiohttp.ClientTimeout = field(init=False)  # of every proxied request: made once
    prefill_timeout: aiohttp.ClientTimeout = field(init=False)  # of a disaggregated request's prefill

    def __post_init__(self) -> None:
        self.proxy_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=CONNECT_S, sock_read=self.settings.proxy_timeout_s
        )
        self.prefill_timeout = aiohttp.ClientTimeout(
            total=self.settings.prefill_timeout_s, sock_connect=CONNECT_S
        )

    @property
    def parse_limit(self) -> int:
        """The biggest request body the router parses (prompts.py says why there is one)."""
        return self.reader.parse_limit if self.reader is not None else MIN_PARSE_LIMIT


ROUTER = web.AppKey("kvpilot_router", Router)
