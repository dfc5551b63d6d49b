"""NVIDIA AIPerf, the real client (`make aiperf`), benchmarks through `kvpilot router` with
`--reset-kv-cache`, run as docs/router.md writes it: its one reset flushes every pod of the fleet, and a
fleet reset that fails stops AIPerf before its first request."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import openai
import pytest

from support import ROOT
from support.procs import free_port
from support.servers import ADMIN_TOKEN, MODEL, Fleet, RouterProc, Server, start_router, stop_router

pytestmark = pytest.mark.timeout(900)

DOC_URL = "http://localhost:8080"  # the router's address in docs/router.md


def documented_commands() -> list[str]:
    """The commands of docs/router.md's AIPerf block, continuation lines joined, comments dropped."""
    text = (ROOT / "docs" / "router.md").read_text()
    block = re.search(r"## Benchmarking through the router with AIPerf.*?```bash\n(.*?)```", text, re.S)
    assert block, "docs/router.md has no AIPerf block"
    lines = block.group(1).replace("\\\n", " ").splitlines()
    return [re.sub(r"\s+#.*$", "", line).strip() for line in lines if line.strip()]


@pytest.fixture(scope="module")
def aiperf_bindir() -> str:
    """The first two documented commands: `make aiperf` (a no-op once `make tools` ran, as in CI) and
    the tools folder, which the user puts on PATH."""
    assert documented_commands()[:2] == ["make aiperf", 'export PATH="$(make -s tools-bindir):$PATH"']
    r = subprocess.run(["make", "-s", "-C", ROOT, "aiperf"], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(["make", "-s", "-C", ROOT, "tools-bindir"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def run_aiperf(bindir: str, router: RouterProc, token: str, cwd: Path) -> subprocess.CompletedProcess:
    """The documented `aiperf profile` command against `router`, with `token` as $KVPILOT_ADMIN_TOKEN;
    AIPerf writes its artifacts under `cwd`."""
    (cmd,) = [c for c in documented_commands() if c.startswith("aiperf profile ")]
    assert DOC_URL in cmd, cmd
    cmd = cmd.replace(DOC_URL, router.url)
    cwd.mkdir(exist_ok=True)
    # Offline mode breaks AIPerf 0.13.0 on a local tokenizer directory (docs/router.md), which it loads
    # without the hub anyway; should anything ask the hub, it fails at once on a closed loopback port.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env |= {
        "PATH": f"{bindir}:{env['PATH']}",
        "KVPILOT_ADMIN_TOKEN": token,
        "HF_ENDPOINT": "http://127.0.0.1:9",
    }
    proc = subprocess.Popen(
        ["bash", "-c", cmd],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        out = None
    finally:
        try:  # AIPerf runs its services as child processes: none may outlive it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if out is None:
        out, _ = proc.communicate()
        raise AssertionError(f"aiperf did not finish within 600 s:\n{out[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def resets(router: RouterProc) -> dict[str, float]:
    m = router.metrics()
    return {
        r: m.get(f'kvpilot_router_fleet_resets_total{{result="{r}"}}', 0.0)
        for r in ("success", "failed", "unauthorized")
    }


def proxied(router: RouterProc) -> float:
    return sum(v for k, v in router.metrics().items() if k.startswith("kvpilot_router_requests_total{"))


def warm_template_prefix(daemon: Server) -> None:
    """Cache the chat template's leading block (SmolLM2's default system prompt) on the daemon: every
    chat request AIPerf sends starts with it, so without a reset its first one would hit the cache."""
    c = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for text in ("warm", "again"):
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16, r.usage


def test_aiperf_reset_kv_cache_through_the_router_flushes_every_pod(
    quiet_fleet: Fleet, aiperf_bindir: str, default_model_dir: Path, tmp_path: Path
) -> None:
    fleet = quiet_fleet
    for d in fleet.daemons:
        warm_template_prefix(d)
    epochs = [d.cache()["epoch"] for d in fleet.daemons]
    before, requests_before = resets(fleet.router), proxied(fleet.router)

    r = run_aiperf(aiperf_bindir, fleet.router, ADMIN_TOKEN, tmp_path)
    assert r.returncode == 0, r.stdout[-6000:]

    # One reset (AIPerf's --api-key is the router's admin token): every pod's epoch went up by one and
    # the router answered 200 (a failed or refused reset would have counted, and stopped AIPerf).
    assert [d.cache()["epoch"] for d in fleet.daemons] == [e + 1 for e in epochs]
    after = resets(fleet.router)
    assert {k: after[k] - before[k] for k in after} == {"success": 1, "failed": 0, "unauthorized": 0}
    # Then AIPerf's two requests, through the router: the first found every cache empty.
    assert proxied(fleet.router) - requests_before == 2
    (export,) = tmp_path.glob("artifacts/**/profile_export.jsonl")
    records = [json.loads(line) for line in export.read_text().splitlines()]
    assert len(records) == 2 and not any("error" in rec for rec in records), records
    first = min(records, key=lambda rec: rec["metadata"]["request_start_ns"])
    assert first["metrics"]["usage_prompt_cache_read_tokens"]["value"] == 0, first["metrics"]


def test_aiperf_stops_when_the_fleet_reset_fails(
    quiet_fleet: Fleet, aiperf_bindir: str, default_model_dir: Path, tmp_path: Path
) -> None:
    good = quiet_fleet.daemons[0]
    dead = f"http://127.0.0.1:{free_port()}"  # a pod nothing listens on: it fails every reset
    router = start_router(tmp_path, [good.url, dead], "--reset-timeout", "5", all_pods=False)
    try:
        epoch = good.cache()["epoch"]
        # Without the router's admin token: 401, which AIPerf does not retry; no pod is touched.
        r = run_aiperf(aiperf_bindir, router, "not-the-token", tmp_path / "unauthorized")
        assert r.returncode == 1, r.stdout[-6000:]
        assert f"{router.url}/reset_prefix_cache failed with status 401" in r.stdout, r.stdout[-6000:]
        assert good.cache()["epoch"] == epoch

        # With it: the router resets the pod it can, answers 502 naming the other, and AIPerf (which
        # retries only 409/423/429/503) exits 1 with a "Control Hook Error" before any request.
        r = run_aiperf(aiperf_bindir, router, ADMIN_TOKEN, tmp_path / "failed")
        assert r.returncode == 1, r.stdout[-6000:]
        assert "Control Hook Error" in r.stdout, r.stdout[-6000:]
        assert f"{router.url}/reset_prefix_cache failed with status 502" in r.stdout, r.stdout[-6000:]
        assert good.cache()["epoch"] == epoch + 1
        assert resets(router) == {"success": 0, "failed": 1, "unauthorized": 1}  # one POST each
        assert proxied(router) == 0
        assert not list(tmp_path.glob("*/artifacts/**/profile_export.jsonl"))
    finally:
        stop_router(router)
