"""Fan-out against real aiohttp stand-in servers on loopback (no cluster): results, retries, deadlines, the
sliding window and the global cap, best-effort progress, a bounded shutdown, and pod identity checks."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from contextlib import asynccontextmanager

from aiohttp import web
from standin import Standin

from kvpilot.fanout import OnCall, PodResult, ResetSettings, Target, run_fanout
from kvpilot.operator import metrics
from kvpilot.operator.resets.drive import outcome
from kvpilot.operator.resets.status import pod_entry, summarize
from support.procs import free_port


@asynccontextmanager
async def serving(standins: list[Standin], port: int):
    """Each stand-in on its own loopback address (127.0.7.N), all on one port, as pods are."""
    runners = []
    try:
        for i, s in enumerate(standins):
            r = web.AppRunner(s.app())
            await r.setup()
            await web.TCPSite(r, f"127.0.7.{i + 1}", port).start()
            runners.append(r)
        yield [Target(f"pod-{i}", f"127.0.7.{i + 1}", "node-1") for i in range(len(standins))]
    finally:
        for r in runners:
            await r.cleanup()


class Recorder:
    """The checkpoint callback: keeps every progress snapshot, as status patches would."""

    def __init__(self, fail: bool = False) -> None:
        self.snapshots: list[list[dict]] = []
        self.fail = fail

    async def __call__(self, records: list[PodResult]) -> None:
        self.snapshots.append([pod_entry(r) for r in records])
        if self.fail:
            raise RuntimeError("the API server said no")


def run(
    standins: list[Standin], settings: ResetSettings | None = None, on_call: OnCall | None = None, **kw
) -> tuple[list[PodResult], Recorder]:
    port = free_port()
    settings = settings or ResetSettings()
    settings = dataclasses.replace(settings, port=port, **kw)
    rec = Recorder()

    async def go() -> list[PodResult]:
        async with serving(standins, port) as targets:
            deadline = time.monotonic() + settings.timeout_s
            return await run_fanout(targets, settings, deadline=deadline, checkpoint=rec, on_call=on_call)

    return asyncio.run(go()), rec


def by_name(records: list[PodResult]) -> dict[str, dict]:
    return {r.name: pod_entry(r) for r in records}


def test_three_kvpilot_pods_succeed_with_their_epochs() -> None:
    s = [Standin() for _ in range(3)]
    s[1].epoch = 41
    records, _ = run(s)
    assert [r.result for r in records] == ["Succeeded"] * 3
    assert by_name(records)["pod-1"]["epoch"] == 42
    assert all(r.evicted_blocks == 7 and r.attempts == 1 and r.http_status == 200 for r in records)
    assert [x.resets for x in s] == [1, 1, 1]
    assert outcome(records)[:2] == ("Succeeded", "AllPodsReset")


def test_500_is_retried_up_to_retries_per_pod_then_failed_others_succeed() -> None:
    s = [Standin(), Standin(reset_status=500), Standin()]
    records, _ = run(s, retries_per_pod=2, backoff_base_s=0.01)
    r = by_name(records)
    assert (
        r["pod-1"]["result"] == "Failed" and r["pod-1"]["attempts"] == 3 and r["pod-1"]["httpStatus"] == 500
    )
    assert "rank 0" in r["pod-1"]["message"] and "retriesPerPod 2" in r["pod-1"]["message"]
    assert r["pod-0"]["result"] == r["pod-2"]["result"] == "Succeeded"
    assert outcome(records)[:2] == ("Failed", "PodsFailed")
    # a policy like a Job's: 2 of 3 is enough with minSuccessRatio 0.6
    assert outcome(records, min_success_ratio=0.6)[:2] == ("Succeeded", "MinSuccessRatioMet")


def test_501_is_not_supported_and_401_fails_without_retry() -> None:
    s = [Standin(reset_status=501), Standin(token="right")]
    records, _ = run(s, token="wrong")
    r = by_name(records)
    assert r["pod-0"]["result"] == "NotSupported" and r["pod-0"]["attempts"] == 1
    assert (
        r["pod-1"]["result"] == "Failed" and r["pod-1"]["httpStatus"] == 401 and r["pod-1"]["attempts"] == 1
    )
    assert s[1].resets == 0


def test_admin_token_is_sent() -> None:
    s = [Standin(token="t0k")]
    records, _ = run(s, token="t0k")
    assert records[0].result == "Succeeded" and s[0].resets == 1


def test_vllm_success_false_is_busy_until_it_resets_or_the_deadline() -> None:
    """vLLM's 200 {"success": false} (running requests hold blocks; "callers may retry") is retried
    until the deadline without counting against retriesPerPod, never taken as a success."""
    s = [Standin(engine="vllm", busy_times=3), Standin(engine="vllm", busy_times=10**6)]
    records, _ = run(
        s, engine="vllm", retries_per_pod=0, backoff_base_s=0.02, backoff_max_s=0.2, timeout_s=2.0
    )
    r = by_name(records)
    assert r["pod-0"]["result"] == "Succeeded" and r["pod-0"]["attempts"] == 4
    assert r["pod-1"]["result"] == "Failed" and r["pod-1"]["httpStatus"] == 200
    assert "timeoutSeconds" in r["pod-1"]["message"] and "success: false" in r["pod-1"]["message"]
    assert s[0].resets == 1 and s[1].resets == 0
    # reset_external=true by default: vLLM's offload tier and connectors are cleared too (vLLM 57727)
    assert set(s[0].asked) == {"/reset_prefix_cache?reset_external=true"}
    assert records[0].name == "pod-0" and records[0].cleared == ["pool", "external"]


def test_sglang_busy_backs_off_until_it_flushes_or_the_deadline() -> None:
    s = [Standin(engine="sglang", busy_times=5), Standin(engine="sglang", busy_times=10**6)]
    records, _ = run(
        s, engine="sglang", retries_per_pod=0, backoff_base_s=0.02, backoff_max_s=0.4, timeout_s=2.0
    )
    r = by_name(records)
    # busy replies do not count against retriesPerPod (0 here): the first pod flushes on its 6th call
    assert r["pod-0"]["result"] == "Succeeded" and r["pod-0"]["attempts"] == 6
    assert r["pod-1"]["result"] == "Failed" and "timeoutSeconds" in r["pod-1"]["message"]
    assert "not flushed while requests run" in r["pod-1"]["message"] and r["pod-1"]["durationSeconds"] < 2.5
    # exponential backoff: over 2 s with waits doubling from 20 ms up to 400 ms, far fewer than the ~100
    # calls a fixed 20 ms pause would make
    assert 6 < r["pod-1"]["attempts"] < 20, r["pod-1"]["attempts"]


def test_unreachable_pod_fails_and_a_gone_or_moved_pod_is_skipped_before_any_call() -> None:
    port = free_port()
    moved = Standin(token="fleet-a")  # listens where pod "moved" used to be: must never see the token
    asked: list[str] = []

    async def gone(t: Target) -> str | None:
        asked.append(t.name)
        return {"gone": "pod deleted", "moved": "pod IP changed"}.get(t.name)

    async def go() -> list[PodResult]:
        async with serving([moved], port):
            targets = [
                Target("down", "127.0.7.200"),
                Target("gone", "127.0.7.201"),
                Target("moved", "127.0.7.1"),
                Target("noip", "", skip_reason="pod has no IP (phase Pending)"),
            ]
            st = ResetSettings(port=port, retries_per_pod=1, backoff_base_s=0.01, token="fleet-a")
            return await run_fanout(
                targets, st, deadline=time.monotonic() + 10, checkpoint=Recorder(), pod_gone=gone
            )

    r = by_name(asyncio.run(go()))
    assert r["down"]["result"] == "Failed" and "cannot connect" in r["down"]["message"]
    assert r["down"]["attempts"] == 2 and asked.count("down") == 2  # asked before every call
    assert (
        r["gone"]["result"] == "Skipped"
        and r["gone"]["message"] == "pod deleted"
        and r["gone"]["attempts"] == 0
    )
    assert r["moved"]["result"] == "Skipped" and moved.calls == 0
    assert r["noip"]["result"] == "Skipped" and r["noip"]["attempts"] == 0 and "noip" not in asked


def test_a_starting_pod_is_waited_for_and_reset_once_up_never_failed() -> None:
    """A pod still loading its model refuses connections: the reset waits for it (no call counted against
    retriesPerPod) and resets it once it is up; one still starting at the deadline is Skipped, reason
    Starting, not Failed. A pod that refuses connections and is not starting still fails as before."""
    port = free_port()
    late = Standin()
    up = asyncio.Event()
    starting = {"late": True, "never": True}

    async def pod_starting(t: Target) -> bool:
        return starting.get(t.name, False)

    async def go() -> list[PodResult]:
        async def come_up() -> None:  # the model loads for a while, then the pod listens and turns Ready
            await asyncio.sleep(1.5)
            runner = web.AppRunner(late.app())
            await runner.setup()
            await web.TCPSite(runner, "127.0.7.1", port).start()
            starting["late"] = False
            up.set()
            await asyncio.sleep(30)
            await runner.cleanup()

        loading = asyncio.create_task(come_up())
        try:
            targets = [
                Target("late", "127.0.7.1"),
                Target("never", "127.0.7.202"),
                Target("down", "127.0.7.203"),
            ]
            st = ResetSettings(port=port, retries_per_pod=1, backoff_base_s=0.01, timeout_s=4)
            return await run_fanout(
                targets, st, deadline=time.monotonic() + 4, checkpoint=Recorder(), pod_starting=pod_starting
            )
        finally:
            loading.cancel()

    records = asyncio.run(go())
    r = by_name(records)
    assert r["late"]["result"] == "Succeeded" and late.resets == 1, r["late"]
    assert r["never"]["result"] == "Skipped" and r["never"]["reason"] == "Starting", r["never"]
    assert "still starting" in r["never"]["message"] and r["never"]["attempts"] == 0
    assert r["down"]["result"] == "Failed" and "cannot connect" in r["down"]["message"]
    assert outcome(records)[:2] == ("Failed", "PodsFailed")
    assert outcome([x for x in records if x.name != "down"])[:2] == ("Succeeded", "AllPodsReset")


def test_a_starting_pod_holds_no_slot_of_the_window() -> None:
    """A window of one, the first pod still loading its model until the deadline: the pod that is up is
    reset all the same (the starting one waits at the back of the queue, not in the slot)."""
    up = Standin()
    port = free_port()

    async def pod_starting(t: Target) -> bool:
        return t.name == "a-loading"

    async def go() -> list[PodResult]:
        async with serving([up], port):
            targets = [Target("a-loading", "127.0.7.203"), Target("b-up", "127.0.7.1")]
            st = ResetSettings(port=port, max_concurrency=1, timeout_s=3)
            return await run_fanout(targets, st, deadline=time.monotonic() + 3, pod_starting=pod_starting)

    r = by_name(asyncio.run(go()))
    assert r["b-up"]["result"] == "Succeeded" and up.resets == 1, r
    assert r["a-loading"]["result"] == "Skipped" and r["a-loading"]["reason"] == "Starting", r


def test_sliding_window_one_slow_pod_does_not_hold_the_others() -> None:
    s = [Standin(delay=1.5)] + [Standin(delay=0.05) for _ in range(24)]
    t0 = time.monotonic()
    records, _ = run(s, max_concurrency=4)
    assert summarize(records)["succeeded"] == 25 and all(x.calls == 1 for x in s)
    # waves of 4 would take 1.5 s + 5 rounds of 50 ms; a sliding window finishes the 24 fast ones on the
    # other 3 workers (8 rounds, 0.4 s) while the slow one runs
    assert time.monotonic() - t0 < 1.5 + 0.5
    assert max(r.duration_s or 0 for r in records[1:]) < 0.5


def test_concurrency_limit_and_the_global_cap_hold_on_one_server() -> None:
    one = Standin(delay=0.1)
    port = free_port()

    async def go() -> None:
        cap = asyncio.Semaphore(5)  # shared by two resets with maxConcurrency 4 each
        async with serving([one], port):
            targets = [Target(f"p{i}", "127.0.7.1") for i in range(12)]  # 12 "pods" behind one address
            st = ResetSettings(port=port, max_concurrency=4)
            await asyncio.gather(*(run_fanout(targets, st, limiter=cap) for _ in range(2)))

    asyncio.run(go())
    assert one.calls == 24 and one.max_inflight == 5


def test_progress_is_best_effort() -> None:
    s = [Standin(delay=0.3) for _ in range(4)]
    port = free_port()
    failing = Recorder(fail=True)

    async def go() -> list[PodResult]:
        async with serving(s, port) as targets:
            st = ResetSettings(port=port, max_concurrency=2, progress_interval_s=0.1)
            return await run_fanout(targets, st, checkpoint=failing)

    records = asyncio.run(go())
    assert summarize(records)["succeeded"] == 4 and len(failing.snapshots) >= 3


def test_timeout_fails_slow_pods_within_the_deadline() -> None:
    s = [Standin(delay=2.5), Standin()]
    records, _ = run(s, timeout_s=1.0, request_timeout_s=1.0, retries_per_pod=0)
    assert max(r.duration_s or 0 for r in records) < 1.5
    r = by_name(records)
    assert r["pod-0"]["result"] == "Failed" and r["pod-1"]["result"] == "Succeeded"


def test_stop_gives_calls_in_flight_a_bounded_grace_and_leaves_the_rest_pending() -> None:
    s = [Standin(delay=0.2), Standin(delay=3.0)] + [Standin() for _ in range(4)]
    port = free_port()

    async def go() -> tuple[list[PodResult], float]:
        async with serving(s, port) as targets:
            stop = asyncio.Event()
            st = ResetSettings(
                port=port, max_concurrency=2, request_timeout_s=60, timeout_s=60, shutdown_grace_s=0.5
            )
            task = asyncio.create_task(run_fanout(targets, st, stop=stop))
            await asyncio.sleep(0.05)
            stop.set()
            t0 = time.monotonic()
            return await task, time.monotonic() - t0

    records, took = asyncio.run(go())
    r = by_name(records)
    assert took < 1.0  # the 3 s call is abandoned after the 0.5 s grace
    assert r["pod-0"]["result"] == "Succeeded"  # finished within the grace
    assert r["pod-1"]["result"] == "Pending"  # in doubt: a restarted operator calls it again
    assert [r[f"pod-{i}"]["result"] for i in range(2, 6)] == ["Pending"] * 4  # never started


def test_base_url_targets_for_the_router() -> None:
    """Targets given as URLs (the fleet router's endpoints), no Kubernetes anywhere."""
    s = [Standin(), Standin()]
    port = free_port()

    async def go() -> list[PodResult]:
        async with serving(s, port):
            targets = [
                Target("a", url=f"http://127.0.7.1:{port}"),
                Target("b", url=f"http://127.0.7.2:{port}/"),
            ]
            return await run_fanout(targets, ResetSettings())  # plain targets, no records needed

    assert [r.result for r in asyncio.run(go())] == ["Succeeded", "Succeeded"]
    assert [x.resets for x in s] == [1, 1]


def test_every_call_reaches_on_call_and_the_operator_counts_it() -> None:
    """The fan-out counts nothing itself: the caller's on_call hears each call; the operator's hook counts
    kvpilot_operator_reset_pod_requests_total{result, code}."""
    heard: list[tuple[str, str]] = []
    sample = ("kvpilot_operator_reset_pod_requests_total", {"result": "Transient", "code": "500"})
    before = metrics.REGISTRY.get_sample_value(*sample) or 0.0

    def on_call(verdict: str, code: str) -> None:
        heard.append((verdict, code))
        metrics.count_pod_call(verdict, code)

    records, _ = run(
        [Standin(), Standin(reset_status=500)], on_call=on_call, retries_per_pod=1, backoff_base_s=0.01
    )
    assert [r.result for r in records] == ["Succeeded", "Failed"]
    assert sorted(heard) == [("Succeeded", "200"), ("Transient", "500"), ("Transient", "500")]
    assert metrics.REGISTRY.get_sample_value(*sample) == before + 2


def test_no_reply_body_is_reported_beyond_a_short_redacted_message() -> None:
    # A pod that echoes the request's headers (the token among them), one whose error is 2 MiB long, one
    # whose body never ends: each is judged from the first bytes of its reply, within a request timeout.
    s = [Standin(reply="echo-headers"), Standin(reply="big"), Standin(reply="endless")]
    token = "fleet-token-" + "k" * 20
    records, _ = run(s, token=token, retries_per_pod=1, backoff_base_s=0.01, request_timeout_s=20)
    r = by_name(records)
    echo, big, endless = r["pod-0"], r["pod-1"], r["pod-2"]
    assert echo["result"] == "Failed" and echo["httpStatus"] == 400, echo
    assert "bad request" in echo["message"] and "[redacted]" in echo["message"], echo
    assert token not in echo["message"] and "Bearer" not in echo["message"].replace("Bearer [redacted]", "")
    assert big["result"] == "Failed" and big["httpStatus"] == 500 and big["attempts"] == 2, big
    assert endless["result"] == "Failed" and endless["httpStatus"] == 500 and endless["attempts"] == 2, (
        endless
    )
    assert endless["message"].startswith("HTTP 500"), endless  # not "no reply within 20s"
    for rec in (echo, big, endless):
        assert len(rec["message"]) < 400, rec["message"][:500]


class CanaryPod:
    """A kvpilot pod that resets, names a model and answers each canary with `usages` in turn (the last
    one repeated): what a broken or lying pod may say about its cache."""

    def __init__(self, *usages: object) -> None:
        self.usages = list(usages)

    async def completion(self, request: web.Request) -> web.Response:
        usage = self.usages.pop(0) if len(self.usages) > 1 else self.usages[0]
        return web.json_response({"object": "text_completion", "usage": usage})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def reset(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True, "epoch": 1, "evicted_by_tier": {"pool": 3, "x" * 9999: 1}})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/reset_prefix_cache", self.reset)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completion)
        return app


def test_a_canary_reply_is_the_pods_word_bounded_and_never_a_false_cold() -> None:
    """Junk usage, absurd counts and a partial hit of a token or two that a control prompt gets too (SGLang
    caches single tokens) are unknown or cold, never a crash of the fan-out; any more of the canary than of
    its control after the reset is warm, half a cache too. A pod's own tier names never reach the result."""

    def usage(cached: object, prompt: object = 300) -> dict:
        return {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}}

    pods = [
        CanaryPod("junk"),  # usage is not an object
        CanaryPod(usage(0), usage(-1)),  # a negative count before the reset
        CanaryPod(usage(0), usage(256), usage(400)),  # more cached than sent after it
        CanaryPod(usage(0), usage(256), usage(2)),  # a BOS and a word in common, the control's too: cold
        CanaryPod(usage(0), usage(256), usage(200), usage(2)),  # still serving the canary: warm
        CanaryPod(usage(0), usage(3)),  # no block's worth before the reset: cannot tell
        CanaryPod(usage(0), usage(256), usage(128), usage(0)),  # half the canary still cached: warm
        CanaryPod(usage(0), usage(256), usage(16), usage("junk")),  # a block, a control without usage
    ]
    records, _ = run(pods, verify=True)
    got = {r.name: (r.result, r.verified, r.reason) for r in records}
    assert got == {
        "pod-0": ("Succeeded", "unknown", ""),
        "pod-1": ("Succeeded", "unknown", ""),
        "pod-2": ("Succeeded", "unknown", ""),
        "pod-3": ("Succeeded", "cold", ""),
        "pod-4": ("Failed", "warm", "StillWarm"),
        "pod-5": ("Succeeded", "unknown", ""),
        "pod-6": ("Failed", "warm", "StillWarm"),
        "pod-7": ("Succeeded", "unknown", ""),
    }, got
    assert "not a completion" in records[0].verify_message and "out of range" in records[1].verify_message
    assert (
        "200 of 300" in records[4].message and "control prompt 2, the canary 256 before" in records[4].message
    )
    assert "no more cached than a control prompt (2)" in records[3].verify_message, records[3].verify_message
    assert all(r.cleared == ["pool"] for r in records), [r.cleared for r in records]


def test_a_kvpilot_pods_canary_fills_three_of_its_blocks() -> None:
    """A kvpilot pod's canary is sized by the block size its /prefix_cache names (a short one costs little),
    within vLLM's 300 words; without a usable block size it is vLLM's length (never too short to fill one)."""
    from kvpilot.fanout.engines import engine_for

    kvpilot, vllm = engine_for("kvpilot"), engine_for("vllm")
    assert [kvpilot.canary_words({"block_size": b}) for b in (1, 16, 32, 128, 4096)] == [
        48,
        48,
        96,
        300,
        300,
    ]
    assert [kvpilot.canary_words(i) for i in (None, {}, {"block_size": "16"}, {"block_size": True})] == [
        300
    ] * 4
    assert vllm.canary_words({"block_size": 16}) == 300


def test_an_sglang_pod_whose_tiers_cannot_be_read_is_not_called_reset() -> None:
    """SGLang's HiCache storage needs its own clear: a pod whose /server_info answers 500 might run one,
    so it fails saying so rather than reading Succeeded after a flush alone; a pod with neither info path
    (404: an SGLang too old for HiCache) is flushed."""

    class InfoPod(Standin):
        info_status: int = 500

        async def info(self, request: web.Request) -> web.Response:
            return web.Response(status=self.info_status)

        def app(self) -> web.Application:
            app = super().app()
            if self.info_status != 404:
                app.router.add_get("/server_info", self.info)
            return app

    broken, old = InfoPod(engine="sglang"), InfoPod(engine="sglang")
    old.info_status = 404
    records, _ = run([broken, old], engine="sglang")
    r = by_name(records)
    assert r["pod-0"]["result"] == "Failed" and "GET /server_info: HTTP 500" in r["pod-0"]["message"], r
    assert broken.calls == 0  # never flushed: the reset is not half done behind a Succeeded
    assert r["pod-1"]["result"] == "Succeeded" and old.calls == 1, r


def test_a_scoped_reset_is_sent_to_kvpilot_pods_and_refused_for_other_engines() -> None:
    from kvpilot.fanout.engines import KvpilotEngine, Verdict
    from kvpilot.kv.reset_scope import ResetScope

    scope = ResetScope(lora_name="policy", cache_salt="a b&c")
    engine = KvpilotEngine()
    (call,) = engine.calls(ResetSettings(scope=scope, reset_running_requests=True), None)
    assert call.path == "/reset_prefix_cache?reset_running_requests=true"
    assert call.body == {"lora_name": "policy", "cache_salt": "a b&c"}
    (call,) = engine.calls(ResetSettings(scope=ResetScope(weight_version="v2")), None)
    assert (call.path, call.body) == ("/reset_prefix_cache", {"weight_version": "v2"})
    # a daemon too old for scoped resets answers a full reset's reply: not the scope asked
    assert engine.judge(call, 200, '{"success": true, "epoch": 3}').verdict == Verdict.FAILED
    scoped = '{"success": true, "epoch": 3, "scope": {"weight_version": "v2"}}'
    assert engine.judge(call, 200, scoped).verdict == Verdict.SUCCEEDED
    for engine in ("vllm", "sglang"):
        settings = ResetSettings(engine=engine, scope=scope)
        (res,) = asyncio.run(run_fanout([Target("p", url=f"http://127.0.0.1:{free_port()}")], settings))
        assert res.result == "NotSupported" and f"{engine} resets its whole cache only" in res.message, res
