"""Small stand-in servers that speak the documented reset replies of kvpilot, vLLM and SGLang.

With `offload` (STANDIN_OFFLOAD=1) a stand-in also serves completions whose usage counts the prompt as cached
when it was seen since the cache was last cleared, from a pool and a CPU offload tier, as vLLM 0.32 does: its
POST /reset_prefix_cache clears the pool, and the offload tier only with reset_external=true (vLLM 57727).
With `block_size` set (a warm-up's tests) it serves chat completions too, names that block size and its
`ranks` in GET /prefix_cache, counts a seen prompt's full blocks as cached (short of its last token, as an
engine does), records each request's X-data-parallel-rank header, answers `pin_prefix` as a kvpilot daemon
does (pinned with `pins`, else reason "disabled"), and with `forget` caches nothing, with `no_details` leaves
`prompt_tokens_details` out of its usage.

Used in-process by the unit tests and as a pod's command by the cluster tests (a daemon where the model
is not the point): `python standin.py --engine kvpilot --host $(POD_IP) --port 8000 [--reset-status 500]`.
Every reset call is counted (GET /calls) so tests can prove that no pod was reset twice. STANDIN_LOAD_SECONDS
makes it wait that long before it listens, as a daemon loading its model does; STANDIN_COMPLETION_DELAY
that long before each completion's reply, as a daemon computing a prompt does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Standin:
    """One stand-in daemon: how it answers a reset, and what it has seen."""

    engine: str = "kvpilot"
    reset_status: int = 200
    delay: float = 0.0  # seconds between applying a reset and replying
    # sglang: replies "not flushed, pending requests" this many times first; vllm: {"success": false}, as
    # vLLM 0.32 answers while running requests hold blocks
    busy_times: int = 0
    token: str | None = None
    # A broken pod's replies to a reset: "echo-headers" answers 400 with the request's headers (as a debug
    # server might), "big" answers 500 with a 2 MiB body, "endless" 500 with a body that never ends; ""
    # answers as the engine does.
    reply: str = ""
    offload: bool = False  # serve completions from a pool and an offload tier (the module's docstring)
    block_size: int | None = None  # a warm-up's stand-in (the module's docstring); None: whole prompts
    ranks: int = 1  # data-parallel ranks named in GET /prefix_cache
    pins: bool = False  # pin_prefix requests are pinned (else "disabled", as a daemon without pinning)
    forget: bool = False  # cache nothing: every prompt cold
    no_details: bool = (
        False  # usage without prompt_tokens_details (vLLM without --enable-prompt-tokens-details)
    )
    completion_delay: float = 0.0  # seconds before a completion's reply
    rank_headers: list[str | None] = field(default_factory=list, init=False)  # per completion request
    completions: int = field(default=0, init=False)  # completion and chat requests received
    pinned: int = field(default=0, init=False)  # requests whose blocks were pinned
    pool: set[str] = field(default_factory=set, init=False)  # (cache_salt, prompt) keys the pool holds
    offloaded: set[str] = field(default_factory=set, init=False)  # and the offload tier
    epoch: int = field(default=0, init=False)
    calls: int = field(default=0, init=False)  # reset calls received
    asked: list[str] = field(default_factory=list, init=False)  # each reset call's path and query
    resets: int = field(default=0, init=False)  # resets applied
    inflight: int = field(default=0, init=False)
    max_inflight: int = field(default=0, init=False)
    # every request but GET /health (the kubelet's readiness probe) and GET /calls (the test's own)
    requests: int = field(default=0, init=False)
    authorized: int = field(default=0, init=False)  # requests that carried an Authorization header

    async def reset(self, request: web.Request) -> web.Response:
        self.calls += 1
        self.asked.append(request.path_qs)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            return await self._reset(request)
        finally:
            self.inflight -= 1

    async def _reset(self, request: web.Request) -> web.Response:
        if self.reply == "echo-headers":
            headers = dict(request.headers)
            text = f"bad request; it came with headers {json.dumps(headers)}"
            return web.json_response({"error": {"message": text}, "headers": headers}, status=400)
        if self.reply == "big":
            return web.json_response({"error": {"message": "x" * (2 << 20)}}, status=500)
        if self.reply == "endless":
            resp = web.StreamResponse(status=500, headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await resp.write(b'{"error": {"message": "')
            while True:  # until the caller hangs up
                await resp.write(b"x" * 65536)
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"error": {"message": "a valid admin token is required"}}, status=401)
        if self.engine == "sglang":
            if self.busy_times > 0:
                self.busy_times -= 1
                return web.Response(
                    status=400,
                    text="Cache not flushed because there are pending requests. #queue-req: 1, #running-req: 1",
                )
            self.resets += 1
            return web.Response(
                text="Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n"
            )
        if self.engine == "vllm" and self.busy_times > 0:
            self.busy_times -= 1
            return web.json_response({"success": False})
        if self.reset_status != 200:
            msg = {501: "this engine has no prefix cache to reset", 503: "the engine is not running"}
            return web.json_response(
                {
                    "error": {
                        "message": msg.get(self.reset_status, "the prefix cache reset failed on rank 0"),
                        "type": "server_error",
                        "param": None,
                        "code": "x",
                    }
                },
                status=self.reset_status,
            )
        # Applied on receipt, replied after `delay`: a caller killed meanwhile leaves a reset that happened.
        self.resets += 1
        self.pool.clear()
        if request.query.get("reset_external") == "true" or self.engine != "vllm":
            self.offloaded.clear()
        self.epoch += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.engine == "vllm":
            return web.json_response({"success": True})
        return web.json_response(
            {
                "success": True,
                "epoch": self.epoch,
                "evicted_blocks": 7,
                "in_flight_requests": 0,
                "preempted_requests": 0,
                "duration_ms": 0.1,
                "ranks": [{"rank": 0, "success": True}],
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "standin", "object": "model"}]})

    async def completion(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.completions += 1
        self.rank_headers.append(request.headers.get("X-data-parallel-rank"))
        if "messages" in body:  # a chat: its template adds two tokens a message
            text = json.dumps(body["messages"])
            tokens = sum(len(m["content"].split()) + 2 for m in body["messages"])
        else:
            text, tokens = body["prompt"], len(body["prompt"].split())
        key = json.dumps([body.get("cache_salt"), body.get("model"), text])
        seen = (key in self.pool or key in self.offloaded) and not self.forget
        if self.block_size is None:
            cached = tokens if seen else 0
        else:
            cached = (tokens - 1) // self.block_size * self.block_size if seen else 0
        self.pool.add(key)
        self.offloaded.add(key)
        usage: dict = {"prompt_tokens": tokens, "completion_tokens": 1, "total_tokens": tokens + 1}
        if not self.no_details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        reply = {"object": "text_completion", "choices": [{"text": " x"}], "usage": usage}
        if self.completion_delay:
            await asyncio.sleep(self.completion_delay)
        if body.get("pin_prefix") is True:
            self.pinned += self.pins
            blocks = tokens // (self.block_size or 16) if self.pins else 0
            reply["pin_prefix"] = {
                "pinned": self.pins,
                "blocks": blocks,
                "reason": None if self.pins else "disabled",
            }
        return web.json_response(reply)

    async def stats(self, request: web.Request) -> web.Response:
        stats: dict = {"epoch": self.epoch, "blocks_total": 64}
        if self.block_size is not None:
            stats["block_size"] = self.block_size
            stats["ranks"] = [{"rank": r} for r in range(self.ranks)]
        return web.json_response(stats)

    async def calls_(self, request: web.Request) -> web.Response:
        counts = {"calls": self.calls, "resets": self.resets, "epoch": self.epoch}
        return web.json_response({**counts, "requests": self.requests, "authorized": self.authorized})

    @web.middleware
    async def count(self, request: web.Request, handler):  # noqa: ANN001, ANN201
        self.requests += request.path not in ("/calls", "/health")
        self.authorized += "Authorization" in request.headers
        return await handler(request)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.count])
        path = "/flush_cache" if self.engine == "sglang" else "/reset_prefix_cache"
        app.router.add_post(path, self.reset)
        app.router.add_get("/prefix_cache", self.stats)
        app.router.add_get("/calls", self.calls_)
        app.router.add_get("/health", self.health)
        if self.offload or self.block_size is not None:
            app.router.add_get("/v1/models", self.models)
            app.router.add_post("/v1/completions", self.completion)
        if self.block_size is not None:
            app.router.add_post("/v1/chat/completions", self.completion)
        return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", default="kvpilot")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--reset-status", type=int, default=200)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--busy-times", type=int, default=0)
    p.add_argument("--token", default=None)
    # Also accepts `kvpilot serve ...` arguments (see shim/kvpilot): flags it does not know are ignored.
    a, _ = p.parse_known_args([x for x in sys.argv[1:] if x != "serve"])
    token = a.token or os.environ.get("KVPILOT_ADMIN_TOKEN") or None
    s = Standin(
        os.environ.get("STANDIN_ENGINE", a.engine),
        int(os.environ.get("STANDIN_RESET_STATUS", a.reset_status)),
        float(os.environ.get("STANDIN_DELAY", a.delay)),
        int(os.environ.get("STANDIN_BUSY_TIMES", a.busy_times)),
        token,
        reply=os.environ.get("STANDIN_REPLY", ""),
        offload=os.environ.get("STANDIN_OFFLOAD") == "1",
        block_size=int(os.environ["STANDIN_BLOCK_SIZE"]) if os.environ.get("STANDIN_BLOCK_SIZE") else None,
        forget=os.environ.get("STANDIN_FORGET") == "1",
        completion_delay=float(os.environ.get("STANDIN_COMPLETION_DELAY", 0)),
    )
    print(json.dumps(vars(a)), flush=True)
    # a daemon loading its model: running, not listening (connections refused) and not Ready meanwhile
    time.sleep(float(os.environ.get("STANDIN_LOAD_SECONDS", 0)))
    web.run_app(s.app(), host=a.host, port=a.port, print=None, handle_signals=True)


if __name__ == "__main__":
    main()
