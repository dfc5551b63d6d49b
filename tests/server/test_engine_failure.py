"""An engine that raises mid-step: in-flight requests fail with a 500, health turns 503, nothing hangs.

In-process server (aiohttp's TestServer) on loopback with the tiny real Llama; the only change to the
engine is a step that raises once asked to, which is the fault under test.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.engine_loop import EngineLoop
from kvpilot.daemon.server.app import ServerSettings, create_app

pytestmark = pytest.mark.timeout(300)


class FaultyEngine(LLMEngine):
    fail_after_steps: int | None = None

    def step(self):  # noqa: ANN201
        if self.fail_after_steps is not None:
            if self.fail_after_steps <= 0:
                raise RuntimeError("injected device failure")
            self.fail_after_steps -= 1
        return super().step()


def test_engine_error_fails_requests_and_marks_unhealthy(tiny_model_dir: Path) -> None:
    engine = FaultyEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))

    async def main() -> None:
        app = create_app(EngineLoop(engine), ServerSettings(served_model_names=["tiny"]))
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        url = f"http://127.0.0.1:{server.port}"
        try:
            async with aiohttp.ClientSession() as s:
                body = {
                    "model": "tiny",
                    "prompt": "hello",
                    "max_tokens": 5,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200  # healthy first
                assert (await s.get(url + "/health")).status == 200

                # Both requests run (the stream has sent its headers) when the engine breaks.
                long = {**body, "max_tokens": 400}
                r2 = await s.post(url + "/v1/completions", json={**long, "stream": True})
                assert r2.status == 200  # headers went out with the first token
                first = await r2.content.readline()
                plain = asyncio.create_task(s.post(url + "/v1/completions", json=long))
                deadline = time.monotonic() + 60
                while len(engine.scheduler.running) < 2:
                    assert time.monotonic() < deadline and not plain.done()
                    await asyncio.sleep(0.005)
                engine.fail_after_steps = 0
                r1 = await asyncio.wait_for(plain, 60)
                assert r1.status == 500
                err = (await r1.json())["error"]
                assert err["code"] == "engine_error" and "injected" not in err["message"]
                text = first.decode() + await asyncio.wait_for(r2.text(), 60)
                events = [line for line in text.splitlines() if line.startswith("data: ")]
                assert json.loads(events[-2][6:])["error"]["code"] == "engine_error"
                assert events[-1] == "data: [DONE]"

                health = await s.get(url + "/health")
                assert health.status == 503 and (await health.json())["status"] == "unhealthy"
                again = await s.post(url + "/v1/completions", json=body)
                assert again.status == 503
                reset = await s.post(url + "/reset_prefix_cache")
                assert reset.status == 503 and "success" not in await reset.json()
        finally:
            await server.close()

    asyncio.run(main())
