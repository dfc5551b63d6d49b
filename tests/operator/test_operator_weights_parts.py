"""WeightUpdate's pure parts and the weight step fan-out against real aiohttp servers on loopback: status
entries (bounded, failures first, tokens redacted), the fleet's weightVersion, the CLI's body, and
run_phase's replies (ok, refusals, silence until the deadline)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from kvpilot.fanout import ResetSettings, Target
from kvpilot.fanout.phase import Step, run_phase, run_steps
from kvpilot.fanout.redact import MAX_REPLY_BYTES
from kvpilot.operator.specs import FleetSpec
from kvpilot.operator.weights.cli import describe_pod, update_body
from kvpilot.operator.weights.status import PodUpdate, fleet_weight_version, pod_status, rank_entries, redact
from support.hostile_pod import endless_json
from support.procs import free_port


def test_status_is_bounded_failures_first_and_redacted() -> None:
    pods = [PodUpdate(f"ok-{i:03d}", "Succeeded", "sha256:a", "v2") for i in range(150)]
    pods.append(PodUpdate("zz", "Fenced", message=redact("commit: Bearer s3cret failed " + "x" * 500)))
    st = pod_status(pods)
    assert (st["targets"], st["succeeded"], st["failed"], st["progress"]) == (151, 150, 1, "150/151")
    assert len(st["pods"]) == 100 and st["podsOmitted"] == 51
    first = st["pods"][0]
    assert first["name"] == "zz" and first["result"] == "Fenced"
    assert "s3cret" not in first["message"] and len(first["message"]) <= 200
    assert st["pods"][1] == {
        "name": "ok-000",
        "result": "Succeeded",
        "stagedDigest": "sha256:a",
        "version": "v2",
    }


def test_rank_entries_and_fleet_version() -> None:
    body = {
        "ranks": [
            {"rank": 0, "weight_version": "v2", "digest": "d"},
            {"rank": 1, "error": "token=abc oom"},
            "x",
        ]
    }
    assert rank_entries(body) == [
        {"rank": 0, "success": True, "version": "v2", "digest": "d"},
        {"rank": 1, "success": False, "message": "token=<redacted> oom"},
    ]
    assert fleet_weight_version(["v2", "v2"]) == {"weightVersion": "v2", "weightVersions": {"v2": 2}}
    assert fleet_weight_version(["v1", "v2", "v2"]) == {
        "weightVersion": "mixed",
        "weightVersions": {"v1": 1, "v2": 2},
    }


def test_cli_body_and_pod_line() -> None:
    args = argparse.Namespace(
        path="/ckpt",
        weight_version="v2",
        strategy=None,
        pause_mode="abort",
        max_unavailable=None,
        timeout_seconds=30,
        adapter=None,
    )
    body = update_body("llm", args)
    assert body["kind"] == "WeightUpdate" and body["metadata"] == {"generateName": "llm-"}
    assert body["spec"] == {
        "targetRef": {"name": "llm"},
        "modelPath": "/ckpt",
        "version": "v2",
        "pauseMode": "abort",
        "timeoutSeconds": 30,
    }
    args.adapter, args.pause_mode, args.timeout_seconds = "sql", None, None
    assert update_body("llm", args)["spec"] == {
        "targetRef": {"name": "llm"},
        "adapter": {"name": "sql", "path": "/ckpt"},
        "version": "v2",
    }
    line = describe_pod({"name": "p", "result": "Failed", "message": "stage: HTTP 404: no checkpoint"})
    assert "Failed" in line and "HTTP 404" in line


@contextlib.asynccontextmanager
async def pods_on(net: str, port: int, apps: list[web.Application]) -> AsyncIterator[list[Target]]:
    """Each app served on `port` of its own loopback address (NET.1, NET.2, ...): a fleet of pods, named
    pod-0, pod-1, ..."""
    runners = []
    try:
        for i, a in enumerate(apps):
            r = web.AppRunner(a)
            runners.append(r)
            await r.setup()
            await web.TCPSite(r, f"{net}.{i + 1}", port).start()
        yield [Target(f"pod-{i}", f"{net}.{i + 1}") for i in range(len(apps))]
    finally:
        for r in runners:
            await r.cleanup()


def update_weights_app(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.Application:
    a = web.Application()
    a.router.add_post("/update_weights", handler)
    return a


def test_run_phase_replies_refusals_and_silence() -> None:
    port = free_port()
    seen: list[tuple[str, dict, str]] = []

    async def ok(request: web.Request) -> web.Response:
        seen.append((request.remote or "", await request.json(), request.headers.get("Authorization", "")))
        return web.json_response({"staged_digest": "sha256:x", "ranks": [{"rank": 0}]})

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "no checkpoint at /nope"}}, status=404)

    async def silent(request: web.Request) -> web.Response:
        await asyncio.sleep(8)
        return web.json_response({})

    async def go() -> tuple[dict, float]:
        async with pods_on("127.0.8", port, [update_weights_app(h) for h in (ok, refuse, silent)]) as targets:
            settings = ResetSettings(port=port, token="t0k", request_timeout_s=60)
            t0 = time.monotonic()
            body = {"update_info": {"model_path": "/ckpt"}}
            replies = await run_phase(targets, settings, "POST", "/update_weights", body, deadline=t0 + 1.5)
            return replies, time.monotonic() - t0

    replies, took = asyncio.run(go())
    assert replies["pod-0"].ok and replies["pod-0"].body["staged_digest"] == "sha256:x"
    assert [s[1:] for s in seen] == [({"update_info": {"model_path": "/ckpt"}}, "Bearer t0k")]
    assert not replies["pod-1"].ok and replies["pod-1"].status == 404
    assert replies["pod-1"].message == "HTTP 404: no checkpoint at /nope"
    assert not replies["pod-2"].ok and replies["pod-2"].status == 0 and "no reply" in replies["pod-2"].message
    assert took < 6  # bounded by the deadline (1.5 s), not by the silent pod or the request timeout


def test_run_phase_reads_a_reply_sent_in_pieces_whole_and_refuses_one_past_the_cap() -> None:
    """A reply that comes in several network reads is judged whole (a plain `content.read(n)` stops at the
    first one); one past MAX_REPLY_BYTES is not read on and fails with that said."""
    port = free_port()

    async def pieces(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"staged_digest": "sha256:')
        await asyncio.sleep(0.2)  # the client has read the first piece by now
        await resp.write(b'x", "ranks": [{"rank": 0}]}')
        await resp.write_eof()
        return resp

    async def go() -> dict:
        async with pods_on(
            "127.0.9", port, [update_weights_app(h) for h in (pieces, endless_json(b'{"ranks": ['))]
        ) as targets:
            settings = ResetSettings(port=port, request_timeout_s=30)
            deadline = time.monotonic() + 30
            return await run_phase(targets, settings, "POST", "/update_weights", {}, deadline=deadline)

    replies = asyncio.run(go())
    assert replies["pod-0"].ok and replies["pod-0"].body == {
        "staged_digest": "sha256:x",
        "ranks": [{"rank": 0}],
    }
    assert not replies["pod-1"].ok and replies["pod-1"].status == 200, replies["pod-1"]
    assert f"a reply over {MAX_REPLY_BYTES} bytes" in replies["pod-1"].message, replies["pod-1"].message


def test_run_steps_stop_at_a_failed_step_per_target_only() -> None:
    port = free_port()
    calls: list[tuple[str, str]] = []

    def app(start_status: int) -> web.Application:
        async def record(request: web.Request) -> web.Response:
            calls.append((request.host, request.path))
            status = start_status if request.path == "/start_weight_update" else 409
            status = 200 if request.path == "/update_weights" else status
            return web.json_response({"ok": True}, status=status)

        a = web.Application()
        for path in ("/abort_weight_update", "/start_weight_update", "/update_weights"):
            a.router.add_post(path, record)
        return a

    async def go() -> dict:
        async with pods_on("127.0.8", port, [app(200), app(500)]) as (good, bad):
            steps = [
                Step("POST", "/abort_weight_update", must_succeed=False),
                Step("POST", "/start_weight_update"),
                Step("POST", "/update_weights"),
            ]
            targets = [Target("good", good.ip), Target("bad", bad.ip)]
            settings = ResetSettings(port=port)
            return await run_steps(targets, settings, steps, deadline=time.monotonic() + 30)

    replies = asyncio.run(go())
    assert [r.status for r in replies["good"]] == [409, 200, 200]  # a refused optional step goes on
    assert [r.status for r in replies["bad"]] == [409, 500]  # a failed required step ends its sequence
    assert (f"127.0.8.2:{port}", "/update_weights") not in calls


def test_fence_decision() -> None:
    from kvpilot.operator.weights.fence import (
        CATCH_UP,
        FENCE,
        LEAVE,
        SERVE,
        WAIT,
        decide,
        recorded_for,
        serving,
    )

    fleet = {"version": "v2", "modelPath": "/ckpt", "digest": "sha256:b"}
    on_v2 = {"weight_version": "v2", "digest": "sha256:b"}
    assert decide(None, {"weight_version": "v1"}, True) == LEAVE  # no recorded weights: never fenced
    assert decide(fleet, on_v2, True) == decide(fleet, on_v2, False) == SERVE
    assert decide(fleet, {"weight_version": "v1", "digest": "sha256:a"}, True) == CATCH_UP  # a restart
    assert decide(fleet, {"weight_version": "v2", "digest": "sha256:z"}, True) == CATCH_UP  # same name, other
    assert decide({"version": "v2"}, {"weight_version": "v2", "digest": "x"}, True) == SERVE  # no digest kept
    assert decide(fleet, None, False) == FENCE  # restarting or loading: it comes back on old weights
    assert decide(fleet, None, True) == WAIT  # Ready, silent once: asked again, not fenced on one miss
    assert serving({"metadata": {"labels": {}}}) and not serving(
        {"metadata": {"labels": {"kvpilot.io/serving": "false"}}}
    )
    # recorded over the default model: they apply while spec.model stays unset, not once it names another
    assert recorded_for({**fleet, "model": ""}, FleetSpec.parse({})) and recorded_for(
        fleet, FleetSpec.parse({"model": None})
    )
    assert not recorded_for({**fleet, "model": ""}, FleetSpec.parse({"model": "/models/other"}))
    assert recorded_for({**fleet, "model": "/m"}, FleetSpec.parse({"model": "/m"})) and not recorded_for(
        {**fleet, "model": "/m"}, FleetSpec.parse({})
    )
