"""`kvpilot bench` against a real daemon: a cold run after each reset, a warm skew without; what it prints
says what it measured (a header, whether the cache was reset, a legend for every column, a table of all runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.servers import ADMIN_TOKEN, Server


def run_bench(
    server: Server, tmp_path: Path, *extra: str, token: str | None = ADMIN_TOKEN
) -> tuple[int, dict, str]:
    out = tmp_path / f"bench{len(extra)}.json"
    env = {k: v for k, v in os.environ.items() if k != "KVPILOT_ADMIN_TOKEN"}
    if token:
        env["KVPILOT_ADMIN_TOKEN"] = token
    cmd = [
        sys.executable,
        "-m",
        "kvpilot",
        "bench",
        "--url",
        server.url,
        "--concurrency",
        "1",
        "2",
        "--rounds",
        "1",
        "--min-requests",
        "2",
        "--max-tokens",
        "2",
        "--output",
        str(out),
        *extra,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    return proc.returncode, json.loads(out.read_text()) if out.exists() else {}, proc.stdout


def final_table(stdout: str) -> list[list[str]]:
    """The rows of the table after "all runs:", split into columns (its two header lines left out)."""
    table = stdout.split("\nall runs:\n", 1)[1].splitlines()
    assert table[0].split()[:3] == ["c", "n", "err"] and "hit" in table[0] and "reset" in table[0], table
    return [line.split() for line in table[2:] if line.strip()]


def test_bench_resets_before_each_run(server: Server, tmp_path: Path) -> None:
    epoch = server.cache()["epoch"]
    rc, report, stdout = run_bench(server, tmp_path)
    assert rc == 0
    runs = report["runs"]
    assert [r["concurrency"] for r in runs] == [1, 2]
    assert all(r["errors"] == 0 and r["output_tokens_per_s"] > 0 for r in runs)
    # warm-up + two runs: three resets, each answered with the next epoch
    assert [r["reset"]["epoch"] for r in runs] == [epoch + 2, epoch + 3]
    # Within a run the shared system prompt is computed once and then hit.
    assert all(0 < r["cache_hit_rate_usage"] < 1 for r in runs)
    header = stdout.split("\ncolumns", 1)[0]
    assert f"server {server.url}, model {report['model']}" in header, stdout
    assert "concurrency 1 2 " in header and "2 2 requests per run" in header, stdout
    assert "max tokens 2" in header and "system prompt shared by all requests" in header, stdout
    assert "prefix cache reset before each run" in header, stdout
    legend = stdout.split("\ncolumns", 1)[1].split("\nall runs:", 1)[0]
    for column in ("c, n, err", "TTFT p50, p99", "ITL p50, p99", "tok/s, req/s", "hit ", "reset "):
        assert f"\n  {column}" in legend, (column, legend)
    assert "usage.cached_tokens / prompt_tokens" in legend, legend
    rows = final_table(stdout)
    assert [row[:3] for row in rows] == [["1", "2", "0"], ["2", "2", "0"]], rows
    assert [row[-2:] for row in rows] == [["epoch", str(epoch + 2)], ["epoch", str(epoch + 3)]], rows
    assert [float(row[-3]) for row in rows] == [round(r["cache_hit_rate_usage"], 2) for r in runs], rows


def test_bench_without_the_admin_token_says_the_reset_was_refused(server: Server, tmp_path: Path) -> None:
    rc, report, stdout = run_bench(server, tmp_path, token=None)
    assert rc == 0  # the load itself ran
    assert all(isinstance(r["reset"], str) and "401" in r["reset"] for r in report["runs"])
    assert [row[-3:] for row in final_table(stdout)] == [["refused", "(HTTP", "401)"]] * 2, stdout


def test_bench_no_reset_leaves_the_cache_alone(server: Server, tmp_path: Path) -> None:
    epoch = server.cache()["epoch"]
    rc, report, stdout = run_bench(server, tmp_path, "--no-reset")
    assert rc == 0
    assert all(r["reset"] is None for r in report["runs"])
    assert server.cache()["epoch"] == epoch
    assert "prefix cache not reset (--no-reset)" in stdout and "reset before each run" not in stdout, stdout
    assert [row[-1] for row in final_table(stdout)] == ["-", "-"], stdout
