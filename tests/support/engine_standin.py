"""Stand-ins for vLLM and SGLang pods behind `kvpilot router --engine vllm|sglang`: their reset, health and
metrics replies byte for byte as the real servers send them (status, body, Content-Type), read from the
released wheels' source.

vLLM 0.33.0 (files under vllm/entrypoints/ in its wheel):
- `POST /reset_prefix_cache[?reset_running_requests=true]` (serve/dev/cache/api_router.py, registered only
  with VLLM_SERVER_DEV_MODE=1, launchers/api_server/routers.py): a JSONResponse, 200 `{"success":true}`, or
  200 `{"success":false}` while blocks are still held (running requests, unless reset_running_requests).
  Without dev mode the route does not exist: FastAPI's 404 `{"detail":"Not Found"}`. A success clears the
  GPU pool; the CPU offload tier (on with state `offload`, vLLM's --kv-offloading-size) only with
  `reset_external=true`: without it vLLM answers success while that tier keeps serving the same blocks
  (vLLM issue 57727, seen with 0.32).
- `POST /v1/completions`: `usage.prompt_tokens_details.cached_tokens` only with --enable-prompt-tokens-details (state `cached_tokens_reported`; off: the field is null). The
  prefix cache is modelled as the (cache_salt, prompt) pairs each tier holds, a word a token: a prompt seen
  before is served from the best tier holding it, in whole blocks of that tier (GPU 16 tokens, CPU offload
  128), the last token always computed.
- `GET /health` (serve/instrumentator/health.py): 200, empty body; 503, empty, once the engine died.
- `GET /metrics` (serve/instrumentator/metrics.py): prometheus_client's make_asgi_app over the default
  registry; the gauges as vllm/v1/metrics/loggers.py declares them: `vllm:num_requests_running`,
  `vllm:num_requests_waiting` (labels model_name, engine: one series per engine, i.e. DP rank),
  `vllm:num_requests_waiting_by_reason` (plus reason) and `vllm:kv_cache_usage_perc`.

SGLang 0.5.23 (files under sglang/srt/ in its wheel):
- `GET|POST /flush_cache` (entrypoints/http_server.py): a Starlette Response without media type (so no
  Content-Type), 200 `Cache flushed.\\nPlease check backend logs for more details. (When there are running
  or waiting requests, the operation will not be performed.)\\n`, or 400 `Flush cache failed.\\n` while
  requests run or wait (managers/scheduler.py flush_cache: not fully idle, FlushCacheReqOutput's message
  empty). It clears the radix tree and, with HiCache (state `enable_hierarchical_cache`), its host pool;
  never the storage tier (SGLang issue 9750).
- `GET /server_info` (and the older `GET /get_server_info`; entrypoints/http_server.py): the server args,
  `enable_hierarchical_cache` and `hicache_storage_backend` (state; null without --hicache-storage-backend)
  among them.
- `GET|POST /clear_hicache_storage_backend` (entrypoints/http_server.py, the deprecated route beside
  `POST /hicache/storage-backend/clear`): a bare Response, `Deprecated endpoint. Use POST
  /hicache/storage-backend/clear.\\nHierarchical cache storage backend cleared.\\n`, 200 when cleared, the
  same text with 400 when not (no storage backend, or state `storage_clear_fails`). The storage tier keeps
  serving a prompt that /flush_cache removed from the device and host until it is cleared.
- `POST /v1/completions`: `usage.prompt_tokens_details.cached_tokens` only with --enable-cache-report
  (state `cached_tokens_reported`; off: no such field); SGLang takes no cache_salt. Page size 1 on every
  tier (its default).
- `GET /health`, `GET /health_generate` (entrypoints/http_server.py): 200, empty; 503, empty, while the
  server is starting. (/health answers without generating unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION.)
- `GET /metrics` only with `--enable-metrics` (utils/common.py add_prometheus_middleware: make_asgi_app
  over a MultiProcessCollector registry, which sorts the labels): `sglang:num_running_reqs`,
  `sglang:num_queue_reqs` as observability/metrics_collector.py declares them (labels model_name,
  engine_type, tp_rank, pp_rank, moe_ep_rank, and dp_rank with DP). Without the flag: 404.

Both are FastAPI apps: an unknown path is 404 `{"detail":"Not Found"}`. Metrics go through
prometheus_client's own exposition, as make_asgi_app sends them (format by Accept, gzip by
Accept-Encoding). Date and Server headers are aiohttp's, not uvicorn's. The OpenAI routes answer a minimal
completion (`GET /v1/models` names one model), so requests can be routed and a canary verified;
`/standin` is the test's control (GET: state, counters of every path asked, prompts held per tier; POST a
JSON object of state keys, and idle_after_s), no engine's.

Run: `python engine_standin.py --engine vllm|sglang --port P [--dp N] [--no-dev-mode] [--no-metrics]`;
`start_standin` does it from a test.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import http.client
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

MODEL = "standin-model"
SGLANG_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
SGLANG_NOT_FLUSHED = "Flush cache failed.\n"
# The deprecated route's text, 200 and 400 alike (entrypoints/http_server.py, SGLang 0.5.x)
SGLANG_STORAGE_CLEARED = "Deprecated endpoint. Use POST /hicache/storage-backend/clear.\nHierarchical cache storage backend cleared.\n"
# Each tier's block in tokens: what a hit is rounded down to. vLLM: the GPU pool's default block_size 16,
# its CPU offload tier's 128-token blocks; SGLang: page_size 1 on every tier (its default).
TIER_BLOCK = {
    "vllm": {"device": 16, "external": 128},
    "sglang": {"device": 1, "host": 1, "storage": 1},
}
NOT_FOUND = b'{"detail":"Not Found"}'  # FastAPI's default 404 (json.dumps with separators=(",", ":"))


class Pod:
    """One stand-in pod: what it answers, and every path it was asked."""

    def __init__(self, engine: str, dp: int, dev_mode: bool, metrics: bool) -> None:
        self.engine, self.dp, self.dev_mode, self.metrics_on = engine, dp, dev_mode, metrics
        self.state: dict[str, Any] = {
            "running": 0,
            "waiting": 0,
            "dead": False,
            "starting": False,
            # vLLM --enable-prompt-tokens-details, SGLang --enable-cache-report: usage names cached_tokens
            "cached_tokens_reported": True,
            "offload": False,  # vLLM: a CPU offload tier (--kv-offloading-size), cleared by reset_external
            "enable_hierarchical_cache": False,  # SGLang --enable-hierarchical-cache: a host tier (L2)
            "hicache_storage_backend": None,  # SGLang --hicache-storage-backend ("file", ...): a storage tier
            "storage_clear_fails": False,  # SGLang: the backend cannot clear (400)
        }
        self.paths: collections.Counter[str] = collections.Counter()
        self.resets = 0  # resets applied (a success was answered)
        # The prefix cache per tier: the (cache_salt, prompt) pairs each holds, as whole prompts.
        self.tiers: dict[str, set[tuple[str, str]]] = {t: set() for t in TIER_BLOCK[engine]}
        self._idle_timer: asyncio.TimerHandle | None = None
        self._gauges, self._registry = self._metrics() if metrics else ({}, None)

    # ---- engine routes ---------------------------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self.state["running"] or self.state["waiting"])

    async def vllm_reset(self, request: web.Request) -> web.Response:
        if not self.dev_mode:
            raise web.HTTPNotFound()
        held = self.state["running"] and not _query_bool(request, "reset_running_requests")
        if not held:
            self.resets += 1
            self.tiers["device"].clear()
            if _query_bool(request, "reset_external"):  # else the offload tier keeps serving (vLLM 57727)
                self.tiers["external"].clear()
        return web.Response(
            body=b'{"success":false}' if held else b'{"success":true}', content_type="application/json"
        )

    async def sglang_flush(self, request: web.Request) -> web.Response:
        if self.busy():
            return web.Response(status=400, body=SGLANG_NOT_FLUSHED.encode())
        self.resets += 1
        self.tiers["device"].clear()
        self.tiers["host"].clear()  # HiCache's host pool goes with the radix tree; its storage does not
        return web.Response(body=SGLANG_FLUSHED.encode())

    async def sglang_server_info(self, request: web.Request) -> web.Response:
        # The server args among the reply's keys (its internal states left out): those a reset reads.
        info = {k: self.state[k] for k in ("enable_hierarchical_cache", "hicache_storage_backend")}
        return web.json_response({"model_path": MODEL, "page_size": TIER_BLOCK["sglang"]["device"], **info})

    async def sglang_clear_storage(self, request: web.Request) -> web.Response:
        ok = bool(self.state["hicache_storage_backend"]) and not self.state["storage_clear_fails"]
        if ok:
            self.tiers["storage"].clear()
        # The same text either way: only the status says whether it cleared.
        return web.Response(status=200 if ok else 400, body=SGLANG_STORAGE_CLEARED.encode())

    async def no_kv_event_sources(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def health(self, request: web.Request) -> web.Response:
        down = self.state["dead"] if self.engine == "vllm" else self.state["starting"]
        return web.Response(status=503 if down else 200)

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client.exposition import _bake_output  # what make_asgi_app runs

        running, waiting = self.state["running"], self.state["waiting"]
        for rank in range(self.dp):
            labels = self._labels(rank)
            self._gauges["running"].labels(**labels).set(_share(running, rank, self.dp))
            self._gauges["waiting"].labels(**labels).set(_share(waiting, rank, self.dp))
            if self.engine == "vllm":
                for reason in ("capacity", "deferred"):
                    count = _share(waiting, rank, self.dp) if reason == "capacity" else 0
                    self._gauges["by_reason"].labels(**labels, reason=reason).set(count)
                self._gauges["usage"].labels(**labels).set(0.25 if running else 0.0)
        status, headers, body = _bake_output(
            self._registry,
            request.headers.get("Accept", ""),
            request.headers.get("Accept-Encoding", ""),
            {k: request.query.getall(k) for k in request.query},
            False,
        )
        return web.Response(status=int(status.split(" ")[0]), body=body, headers=dict(headers))

    def cached_tokens(self, key: tuple[str, str], tokens: int) -> int:
        """What the prefix cache serves of a prompt: the best tier holding it, in whole blocks of that tier,
        the last token always computed; then the prompt is stored in every tier the server runs."""
        cached = max(
            (
                (tokens - 1) // block * block
                for t, block in TIER_BLOCK[self.engine].items()
                if key in self.tiers[t]
            ),
            default=0,
        )
        for tier in self._running_tiers():
            self.tiers[tier].add(key)
        return cached

    def _running_tiers(self) -> list[str]:
        if self.engine == "vllm":
            return ["device", *(["external"] if self.state["offload"] else [])]
        hicache = self.state["enable_hierarchical_cache"]
        storage = hicache and self.state["hicache_storage_backend"]
        return ["device", *(["host"] if hicache else []), *(["storage"] if storage else [])]

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            body = {}
        body = body if isinstance(body, dict) else {}
        chat = request.path.endswith("/chat/completions")
        prompt = str(body.get("prompt" if not chat else "messages", ""))
        tokens = max(1, len(prompt.split()))  # a word a token
        salt = str(body.get("cache_salt", "")) if self.engine == "vllm" else ""  # SGLang has no cache_salt
        usage: dict[str, Any] = {"prompt_tokens": tokens, "completion_tokens": 1, "total_tokens": tokens + 1}
        cached = self.cached_tokens((salt, prompt), tokens)
        if self.state["cached_tokens_reported"]:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        elif self.engine == "vllm":
            usage["prompt_tokens_details"] = None  # vLLM's UsageInfo sends the field, null
        choice = {"index": 0, "finish_reason": "stop"}
        choice |= {"message": {"role": "assistant", "content": "ok"}} if chat else {"text": "ok"}
        return web.json_response(
            {
                "id": "cmpl-standin",
                "object": "chat.completion" if chat else "text_completion",
                "created": 0,
                "model": MODEL,
                "choices": [choice],
                "usage": usage,
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": self.engine}]}
        )

    # ---- the test's control --------------------------------------------------------------------------
    async def get_state(self, request: web.Request) -> web.Response:
        tiers = {tier: len(held) for tier, held in self.tiers.items()}
        return web.json_response(
            {**self.state, "resets": self.resets, "paths": dict(self.paths), "tiers": tiers}
        )

    async def set_state(self, request: web.Request) -> web.Response:
        update = await request.json()
        idle_after = update.pop("idle_after_s", None)
        self.state.update(update)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if idle_after is not None:  # the running and waiting requests finish then
            self._idle_timer = asyncio.get_running_loop().call_later(
                idle_after, self.state.update, {"running": 0, "waiting": 0}
            )
        return await self.get_state(request)

    # ---- plumbing ------------------------------------------------------------------------------------
    def _labels(self, rank: int) -> dict[str, str]:
        if self.engine == "vllm":
            return {"model_name": MODEL, "engine": str(rank)}
        labels = {
            "model_name": MODEL,
            "engine_type": "unified",
            "tp_rank": "0",
            "pp_rank": "0",
            "moe_ep_rank": "0",
        }
        return labels | ({"dp_rank": str(rank)} if self.dp > 1 else {})

    def _metrics(self) -> tuple[dict[str, Any], Any]:
        # Imported only now: SGLang's prometheus_client runs in multiprocess mode, which it reads from
        # PROMETHEUS_MULTIPROC_DIR when first imported (main() sets it).
        from prometheus_client import REGISTRY, CollectorRegistry, Gauge, multiprocess

        names = list(self._labels(0))
        if self.engine == "vllm":
            gauges = {
                "running": Gauge(
                    "vllm:num_requests_running",
                    "Number of requests in model execution batches.",
                    multiprocess_mode="mostrecent",
                    labelnames=names,
                ),
                "waiting": Gauge(
                    "vllm:num_requests_waiting",
                    "Number of requests waiting to be processed.",
                    multiprocess_mode="mostrecent",
                    labelnames=names,
                ),
                "by_reason": Gauge(
                    "vllm:num_requests_waiting_by_reason",
                    "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
                    "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
                    "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
                    multiprocess_mode="mostrecent",
                    labelnames=[*names, "reason"],
                ),
                "usage": Gauge(
                    "vllm:kv_cache_usage_perc",
                    "KV-cache usage. 1 means 100 percent usage.",
                    multiprocess_mode="mostrecent",
                    labelnames=names,
                ),
            }
            return gauges, REGISTRY
        gauges = {
            "running": Gauge(
                "sglang:num_running_reqs",
                "The number of running requests.",
                labelnames=names,
                multiprocess_mode="mostrecent",
            ),
            "waiting": Gauge(
                "sglang:num_queue_reqs",
                "The number of requests in the waiting queue.",
                labelnames=names,
                multiprocess_mode="mostrecent",
            ),
        }
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return gauges, registry

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._count_and_404])
        app.on_response_prepare.append(_no_default_content_type)
        if self.engine == "vllm":
            app.router.add_post("/reset_prefix_cache", self.vllm_reset)
            app.router.add_get("/health", self.health)
            # vLLM 0.32 without --kv-events-config: no rank publishes (vllm/entrypoints/serve/instrumentator)
            app.router.add_get("/kv_event_sources", self.no_kv_event_sources)
        else:
            app.router.add_route("GET", "/flush_cache", self.sglang_flush)
            app.router.add_route("POST", "/flush_cache", self.sglang_flush)
            app.router.add_get("/health", self.health)
            app.router.add_get("/health_generate", self.health)
            app.router.add_get("/server_info", self.sglang_server_info)
            app.router.add_get("/get_server_info", self.sglang_server_info)
            app.router.add_route("GET", "/clear_hicache_storage_backend", self.sglang_clear_storage)
            app.router.add_route("POST", "/clear_hicache_storage_backend", self.sglang_clear_storage)
        if self.metrics_on:
            app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/standin", self.get_state)
        app.router.add_post("/standin", self.set_state)
        return app

    @web.middleware
    async def _count_and_404(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path != "/standin":
            self.paths[f"{request.method} {request.path}"] += 1
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return web.Response(status=404, body=NOT_FOUND, content_type="application/json")


def _query_bool(request: web.Request, name: str) -> bool:
    """A boolean query parameter as FastAPI reads one (absent: false)."""
    return request.query.get(name, "").lower() in ("1", "true", "yes", "on")


def _share(total: int, rank: int, ranks: int) -> int:
    """Rank `rank`'s part of `total` requests spread over `ranks` ranks."""
    return total // ranks + (1 if rank < total % ranks else 0)


async def _no_default_content_type(request: web.Request, response: web.StreamResponse) -> None:
    """Starlette sends a body without media type bare; aiohttp would label it application/octet-stream."""
    if response.headers.get("Content-Type") == "application/octet-stream":
        del response.headers["Content-Type"]


# ---- from a test -----------------------------------------------------------------------------------------
@dataclass
class EngineStandin:
    engine: str
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        """As the router names the pod (`--endpoints`)."""
        return f"127.0.0.1:{self.port}"

    def _call(self, method: str, body: dict | None = None) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            raw = json.dumps(body).encode() if body is not None else None
            conn.request(method, "/standin", body=raw, headers={"Content-Type": "application/json"})
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def state(self) -> dict:
        """running, waiting, dead, starting; resets applied; paths: {"METHOD /path": times asked}."""
        return self._call("GET")

    def set(self, **state: Any) -> dict:
        return self._call("POST", state)


def start_standin(tmp: Path, engine: str, *args: str) -> EngineStandin:
    from support.procs import free_port, spawn, wait_ready

    port = free_port()
    log_path = tmp / f"{engine}-standin-{port}.log"
    argv = [sys.executable, __file__, "--engine", engine, "--port", str(port), *args]
    standin = EngineStandin(engine, spawn(argv, log_path=log_path), port, log_path)

    def up() -> bool:
        try:
            return "running" in standin.state()
        except OSError:
            return False

    wait_ready(standin.proc, up, 30, f"{engine} stand-in", log_path, interval=0.1)
    return standin


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks: one metrics series each")
    p.add_argument(
        "--no-dev-mode", dest="dev_mode", action="store_false", help="vLLM without VLLM_SERVER_DEV_MODE=1"
    )
    p.add_argument(
        "--no-metrics", dest="metrics", action="store_false", help="SGLang without --enable-metrics"
    )
    a = p.parse_args()
    if a.engine == "sglang" and a.metrics:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="sglang-standin-metrics-")
    pod = Pod(a.engine, a.dp, a.dev_mode, a.metrics)
    web.run_app(pod.app(), host=a.host, port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
