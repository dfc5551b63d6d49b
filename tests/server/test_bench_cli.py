"""`kvpilot bench` against a real daemon: a cold run after each reset, a warm skew without."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.servers import ADMIN_TOKEN, Server


def run_bench(
    server: Server, tmp_path: Path, *extra: str, token: str | None = ADMIN_TOKEN
) -> tuple[int, dict]:
    out = tmp_path / f"bench{len(extra)}.json"
    env = {k: v for k, v in os.environ.items() if k != "KVPILOT_ADMIN_TOKEN"}
    if token:
        env["KVPILOT_ADMIN_TOKEN"] = token
    cmd = [sys.executable, "-m", "kvpilot", "bench", "--url", server.url, "--concurrency", "1", "2",
           "--rounds", "1", "--min-requests", "2", "--max-tokens", "2", "--output", str(out), *extra]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    return proc.returncode, json.loads(out.read_text()) if out.exists() else {}


def test_bench_resets_before_each_run(server: Server, tmp_path: Path) -> None:
    epoch = server.cache()["epoch"]
    rc, report = run_bench(server, tmp_path)
    assert rc == 0
    runs = report["runs"]
    assert [r["concurrency"] for r in runs] == [1, 2]
    assert all(r["errors"] == 0 and r["output_tokens_per_s"] > 0 for r in runs)
    # warm-up + two runs: three resets, each answered with the next epoch
    assert [r["reset"]["epoch"] for r in runs] == [epoch + 2, epoch + 3]
    # Within a run the shared system prompt is computed once and then hit.
    assert all(0 < r["cache_hit_rate_usage"] < 1 for r in runs)


def test_bench_without_the_admin_token_says_the_reset_was_refused(server: Server, tmp_path: Path) -> None:
    rc, report = run_bench(server, tmp_path, token=None)
    assert rc == 0  # the load itself ran
    assert all(isinstance(r["reset"], str) and "401" in r["reset"] for r in report["runs"])


def test_bench_no_reset_leaves_the_cache_alone(server: Server, tmp_path: Path) -> None:
    epoch = server.cache()["epoch"]
    rc, report = run_bench(server, tmp_path, "--no-reset")
    assert rc == 0
    assert all(r["reset"] is None for r in report["runs"])
    assert server.cache()["epoch"] == epoch
