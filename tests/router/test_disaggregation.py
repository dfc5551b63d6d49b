"""The router's prefill/decode mode (`kvpilot router --prefill URL... --decode URL...`, router/disaggregation.py):
the bodies it sends each role (vllm-router's), its flags, and the real router in front of stand-in pods on
loopback that answer a prefill with `kv_transfer_params` or fail it each way (an error, no params, silence),
recording every body they get. tests/router/test_disaggregation_real.py runs it on real daemons."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvpilot.protocol.kv_transfer import PREFILL_ASK
from kvpilot.router.app import create_app
from kvpilot.router.app_state import Router
from kvpilot.router.disaggregation import decode_body, prefill_body, transfer_params
from kvpilot.router.fleet.pods import DECODE, PREFILL, Fleet, Pod, parse_pools
from kvpilot.router.kv.index import PrefixIndex
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.routing.policy import make_policy
from kvpilot.router.settings import RouterSettings
from support.procs import wait_for
from support.servers import ADMIN_TOKEN, RouterProc, start_router, stop_router

pytestmark = pytest.mark.timeout(120)

# What a kvpilot prefill pod answers in its reply's kv_transfer_params (docs/disaggregation.md).
HELD = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "engine-7",
    "remote_request_id": "0f" * 16,
    "remote_host": "10.0.0.7",
    "remote_port": 14579,
    "remote_block_ids": [0, 1],
    "tp_size": 1,
    "remote_block_keys": ["ab" * 32, "cd" * 32],
    "remote_epoch": 3,
    "block_size": 16,
}
CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "Hi!"}],
    "max_tokens": 8,
    "max_completion_tokens": 8,
    "min_tokens": 2,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0,
}


# ---- the bodies ------------------------------------------------------------------------------------
def test_a_prefill_is_the_clients_body_for_one_token_not_streamed_asking_for_a_remote_decode() -> None:
    body = json.loads(prefill_body(CHAT))
    assert body == {
        "model": "m",
        "messages": CHAT["messages"],
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "temperature": 0,
        "kv_transfer_params": PREFILL_ASK,
    }
    # vllm-router's exact fields
    assert PREFILL_ASK == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    completion = json.loads(prefill_body({"model": "m", "prompt": "Hi", "max_tokens": 30}))
    assert completion == {
        "model": "m",
        "prompt": "Hi",
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": PREFILL_ASK,
    }


def test_a_decode_is_the_clients_body_with_the_prefills_params_as_they_came() -> None:
    assert json.loads(decode_body(CHAT, HELD)) == {**CHAT, "kv_transfer_params": HELD}
    # the router owns the field: a client's own is never passed on, with params or without
    own = {**CHAT, "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "attacker.example"}}
    assert json.loads(decode_body(own, HELD))["kv_transfer_params"] == HELD
    assert json.loads(decode_body(own, None)) == CHAT


@pytest.mark.parametrize(
    ("reply", "params"),
    [
        ({"choices": [], "kv_transfer_params": HELD}, HELD),
        ({"choices": []}, None),
        ({"kv_transfer_params": None}, None),
        ({"kv_transfer_params": ["not", "an", "object"]}, None),
        ([1, 2], None),
        ("not json", None),
    ],
)
def test_a_prefill_reply_hands_over_only_an_object_of_kv_transfer_params(
    reply: object, params: object
) -> None:
    raw = reply.encode() if isinstance(reply, str) else json.dumps(reply).encode()
    assert transfer_params(raw)[0] == params


def test_prefill_and_decode_pods_parse_with_their_roles_as_vllm_router_names_them() -> None:
    pods = parse_pools(["http://a:8000", "b:8001,http://c:8002"], ["http://d:9000"])
    assert [(p.name, p.role) for p in pods] == [
        ("a:8000", PREFILL),
        ("b:8001", PREFILL),
        ("c:8002", PREFILL),
        ("d:9000", DECODE),
    ]
    with pytest.raises(ValueError, match="a:8000 is named by both --prefill and --decode"):
        parse_pools(["http://a:8000"], ["a:8000"])
    with pytest.raises(ValueError, match="--prefill 9000: a bootstrap port"):
        parse_pools(["http://a:8000", "9000"], ["http://d:9000"])
    with pytest.raises(ValueError, match="--decode: a:1 is listed twice"):
        parse_pools(["http://b:1"], ["a:1", "a:1"])


# ---- the flags -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--prefill", "http://a:1"], "--prefill needs --decode"),
        (["--endpoints", "http://a:1", "--decode", "http://b:1"], "--decode needs --prefill"),
        (["--endpoints", "http://a:1", "--prefill", "http://b:1"], "not allowed with argument --endpoints"),
        (
            [
                "--prefill",
                "http://a:1",
                "--decode",
                "http://b:1",
                "--engine",
                "sglang",
                "--policy",
                "least-load",
            ],
            "--engine kvpilot or vllm",
        ),
        (
            ["--prefill", "http://a:1", "--decode", "http://b:1", "--endpoint-picker-port", "9"],
            "--endpoint-picker-port picks one pod",
        ),
        (
            ["--prefill", "http://a:1", "--decode", "http://b:1", "--prefill-timeout", "0"],
            "--prefill-timeout",
        ),
    ],
)
def test_a_disaggregated_router_refuses_what_it_cannot_do_in_one_line(args: list[str], error: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvpilot", "router", *args], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert error in r.stderr, r.stderr


# ---- the real router, stand-in pods ----------------------------------------------------------------
class StandinPod:
    """A kvpilot pod of one role on loopback, served by a thread of the test: healthy, no KV events (the
    router routes it by load), a reset that succeeds, and generation routes that record each body.

    A request asking for a remote decode (a prefill) is answered by `prefill`: "params" (a one-token
    completion with HELD), "none" (the same without), "error" (500) or "silent"; any other (a decode)
    with a completion, or a stream when asked, whose text says whether it got kv_transfer_params."""

    def __init__(self) -> None:
        self.prefill = "params"
        self.bodies: list[tuple[str, dict]] = []
        self.resets = 0
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        assert started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/kv_events", self._health)  # 404 there: publishes no KV events
        app.router.add_post("/reset_prefix_cache", self._reset)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.name = f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.url = f"http://{self.name}"
        started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"}, status=200 if request.path == "/health" else 404)

    async def _reset(self, request: web.Request) -> web.Response:
        self.resets += 1
        return web.json_response({"success": True, "epoch": self.resets, "evicted_blocks": 0})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append((request.path, body))
        usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            if self.prefill == "silent":
                await asyncio.sleep(3600)
            if self.prefill == "error":
                return web.json_response({"error": {"message": "boom"}}, status=500)
            reply = {"choices": [{"index": 0, "text": "x"}], "usage": usage}
            if self.prefill == "params":
                reply["kv_transfer_params"] = HELD
            return web.json_response(reply)
        text = "with params" if "kv_transfer_params" in body else "computed here"
        if not body.get("stream"):
            return web.json_response({"choices": [{"index": 0, "text": text}], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in (text, "!"):
            await resp.write(
                b"data: " + json.dumps({"choices": [{"index": 0, "text": piece}]}).encode() + b"\n\n"
            )
        await resp.write(b"data: [DONE]\n\n")
        return resp


class PdStandins:
    def __init__(self, prefill: StandinPod, decode: StandinPod, router: RouterProc) -> None:
        self.prefill, self.decode, self.router = prefill, decode, router

    def outcomes(self) -> dict[str, float]:
        m = self.router.metrics()
        return {k.split('"')[1]: v for k, v in m.items() if k.startswith("kvpilot_router_pd_requests_total{")}


@pytest.fixture(scope="module")
def standins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdStandins]:
    prefill, decode = StandinPod(), StandinPod()
    router = None
    try:
        tmp = tmp_path_factory.mktemp("pd-standins")
        # round-robin: stand-ins publish no KV events, and the router then needs no tokenizer
        args = [
            "--prefill",
            prefill.url,
            "--decode",
            decode.url,
            "--policy",
            "round-robin",
            "--prefill-timeout",
            "2",
        ]
        router = start_router(tmp, None, *args, all_pods=False)
        yield PdStandins(prefill, decode, router)
    finally:
        if router is not None:
            stop_router(router)
        prefill.stop()
        decode.stop()


@pytest.fixture
def pd(standins: PdStandins) -> PdStandins:
    standins.prefill.prefill = "params"
    standins.prefill.bodies.clear()
    standins.decode.bodies.clear()
    # a test whose prefill failed after it was sent left the pod out until its next probe (every 2 s)
    wait_for(lambda: all(p["ready"] for p in standins.router.health()["pods"]), 10, "both pods ready")
    return standins


def test_a_chat_is_prefilled_then_decoded_with_the_prefills_params(pd: PdStandins) -> None:
    before = pd.outcomes()
    r = pd.router.request("POST", "/v1/chat/completions", {**CHAT, "stream": False})
    assert r.status == 200, r.body
    assert r.json()["choices"][0]["text"] == "with params"
    assert r.headers["X-Kvpilot-Pod"] == pd.decode.name
    [(path, prefill)] = pd.prefill.bodies
    [(decode_path, decode)] = pd.decode.bodies
    assert path == decode_path == "/v1/chat/completions"
    assert prefill == json.loads(prefill_body({**CHAT, "stream": False}))
    assert decode == {**CHAT, "stream": False, "kv_transfer_params": HELD}
    after = pd.outcomes()
    assert after["transferred"] == before["transferred"] + 1, (before, after)


def test_a_streamed_completion_comes_back_streamed_from_the_decode_pod(pd: PdStandins) -> None:
    body = {"model": "m", "prompt": "Hi", "max_tokens": 4, "stream": True}
    r = pd.router.request("POST", "/v1/completions", body)
    assert r.status == 200, r.body
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = [line[6:] for line in r.body.decode().splitlines() if line.startswith("data: ")]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["with params", "!"]
    assert events[-1] == "[DONE]"
    assert pd.prefill.bodies[0][1]["stream"] is False
    assert pd.decode.bodies[0][1] == {**body, "kv_transfer_params": HELD}


@pytest.mark.parametrize(
    ("prefill", "outcome"),
    [("error", "prefill_failed"), ("none", "no_kv_transfer_params"), ("silent", "prefill_failed")],
)
def test_a_failed_prefill_costs_the_request_only_its_transfer(
    pd: PdStandins, prefill: str, outcome: str
) -> None:
    pd.prefill.prefill = prefill
    before = pd.outcomes()
    # the client's own kv_transfer_params are dropped as well: the decode pod computes the prompt
    body = {"model": "m", "prompt": "Hi", "max_tokens": 4, "kv_transfer_params": {"do_remote_prefill": True}}
    r = pd.router.request("POST", "/v1/completions", body)
    assert r.status == 200, r.body
    assert r.json()["choices"][0]["text"] == "computed here"
    [(_, decode)] = pd.decode.bodies
    assert "kv_transfer_params" not in decode and decode["max_tokens"] == 4
    after = pd.outcomes()
    assert after[outcome] == before[outcome] + 1, (before, after)
    assert f"prefill on {pd.prefill.name}" in pd.router.log()
    if prefill == "silent":  # a prefill that failed after it was sent keeps the pod out until its next probe
        assert "no reply within 2 s" in pd.router.log()


def test_a_body_that_is_no_json_object_goes_to_the_decode_pod_as_it_came(pd: PdStandins) -> None:
    before = pd.outcomes()
    r = pd.router.request("POST", "/v1/completions", b"[1, 2]")
    assert r.status == 500  # the stand-in's own answer to a body it cannot read
    assert not pd.prefill.bodies
    assert pd.outcomes()["unparsed"] == before["unparsed"] + 1


def test_health_and_the_reset_name_each_pods_role(pd: PdStandins) -> None:
    health = pd.router.health()
    assert {p["pod"]: p["role"] for p in health["pods"]} == {
        pd.prefill.name: "prefill",
        pd.decode.name: "decode",
    }
    resets = pd.prefill.resets, pd.decode.resets
    r = pd.router.request(
        "POST", "/reset_prefix_cache?verify=false", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    assert r.status == 200, r.body
    assert {p["pod"]: (p["role"], p["success"]) for p in r.json()["pods"]} == {
        pd.prefill.name: ("prefill", True),
        pd.decode.name: ("decode", True),
    }
    assert (pd.prefill.resets, pd.decode.resets) == (resets[0] + 1, resets[1] + 1)


def test_the_decode_pool_is_what_serves(tmp_path: Path) -> None:
    """No decode pod ready: 503 before any prefill (its KV would have no taker)."""
    prefill = StandinPod()
    try:
        router = start_router(
            tmp_path,
            None,
            *("--prefill", prefill.url, "--decode", "http://127.0.0.1:9", "--policy", "round-robin"),
            all_pods=False,
            no_pod=True,
        )
        try:
            assert router.health()["status"] == "no_ready_pod"
            r = router.request("POST", "/v1/completions", {"model": "m", "prompt": "Hi"})
            assert r.status == 503, r.body
            assert r.json()["error"]["code"] == "no_ready_pod"
            assert not prefill.bodies
        finally:
            stop_router(router)
    finally:
        prefill.stop()


# ---- the mode follows the pods' roles --------------------------------------------------------------
def test_the_mode_follows_the_pods_roles_without_a_restart() -> None:
    """A --fleet router's pods take or lose roles when its InferenceDeployment is switched (discovery.py):
    the same router, in-process, runs a chat as P/D while the pods have roles and whole on one pod once
    they have none, each P/D outcome's series shown from the first list with roles."""
    prefill, decode = StandinPod(), StandinPod()

    def listed(roles: bool) -> list[Pod]:
        return [
            Pod(p.name, p.url, role=r if roles else None) for p, r in ((prefill, PREFILL), (decode, DECODE))
        ]

    async def run() -> None:
        index, metrics = PrefixIndex(), RouterMetrics()
        async with aiohttp.ClientSession() as session:
            fleet = Fleet(index, metrics, session, probe_interval_s=0.2)
            # as `kvpilot router --fleet` makes it: settings.disaggregated is --prefill/--decode's alone
            router = Router(
                RouterSettings(policy="round-robin", prefill_timeout_s=2),
                fleet,
                index,
                make_policy("round-robin", index),
                None,
                metrics,
                session,
                make_policy("round-robin", index),
            )
            client = TestClient(TestServer(create_app(router)))
            await client.start_server()
            try:
                fleet.update(listed(roles=False))
                await fleet.first_probes(10)
                assert not fleet.disaggregated
                assert "pd_requests_total{" not in metrics.render().decode()

                async def chat() -> tuple[str, str]:
                    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": False})
                    assert r.status == 200, await r.text()
                    return r.headers["X-Kvpilot-Pod"], (await r.json())["choices"][0]["text"]

                # colocated: whole on one pod, no prefill anywhere
                assert await chat() in {(prefill.name, "computed here"), (decode.name, "computed here")}
                fleet.update(listed(roles=True))
                assert fleet.disaggregated
                assert 'pd_requests_total{outcome="transferred"} 0.0' in metrics.render().decode()
                prefill.bodies.clear()
                decode.bodies.clear()
                assert await chat() == (decode.name, "with params")
                assert [b["kv_transfer_params"] for _, b in prefill.bodies] == [PREFILL_ASK]
                assert 'pd_requests_total{outcome="transferred"} 1.0' in metrics.render().decode()
                # an empty list (a fleet scaled to zero) keeps the mode; pods without roles end it
                fleet.update([])
                assert fleet.disaggregated
                fleet.update(listed(roles=False))
                await fleet.first_probes(10)
                assert not fleet.disaggregated
                prefill.bodies.clear()
                decode.bodies.clear()
                await chat()
                assert all("kv_transfer_params" not in b for _, b in prefill.bodies + decode.bodies)
                assert len(prefill.bodies + decode.bodies) == 1
            finally:
                await client.close()
                await fleet.stop()

    try:
        asyncio.run(run())
    finally:
        prefill.stop()
        decode.stop()
