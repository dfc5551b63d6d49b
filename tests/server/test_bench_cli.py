"""`kvpilot bench` against a real daemon: a cold run after each reset, a warm skew without; what it prints
says what it measured (a header, whether the cache was reset, a legend for every column, a table of all runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support import ROOT
from support.servers import ADMIN_TOKEN, Server


def run_bench(
    url: str, tmp_path: Path, *extra: str, token: str | None = ADMIN_TOKEN
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
        url,
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
    assert table[0].split()[:3] == ["c", "n", "err"] and table[0].split()[-5:] == [
        "hit",
        "warm",
        "pred",
        "verified",
        "reset",
    ], table
    return [line.split() for line in table[2:] if line.strip()]


def test_bench_resets_before_each_run(server: Server, tmp_path: Path) -> None:
    epoch = server.cache()["epoch"]
    rc, report, stdout = run_bench(server.url, tmp_path)
    assert rc == 0
    runs = report["runs"]
    assert [r["concurrency"] for r in runs] == [1, 2]
    assert all(r["errors"] == 0 and r["output_tokens_per_s"] > 0 for r in runs)
    # warm-up + two runs: three resets, each answered with the next epoch, each proven cold by its canary
    assert [r["reset"]["epoch"] for r in runs] == [epoch + 2, epoch + 3]
    assert [r["reset"]["verified"] for r in runs] == ["cold", "cold"], runs
    assert all("found nothing cached" in r["reset"]["verify_message"] for r in runs), runs
    # Within a run the shared system prompt is computed once and then hit.
    assert all(0 < r["cache_hit_rate_usage"] < 1 for r in runs)
    header = stdout.split("\ncolumns", 1)[0]
    assert f"server {server.url}, model {report['model']}" in header, stdout
    assert "concurrency 1 2 " in header and "2 2 requests per run" in header, stdout
    assert "max tokens 2" in header and "system prompt shared by all requests" in header, stdout
    assert "prefix cache reset before each run and verified cold by a canary" in header, stdout
    legend = stdout.split("\ncolumns", 1)[1].split("\nall runs:", 1)[0]
    for column in (
        "c, n, err",
        "TTFT p50, p99",
        "ITL p50, p99",
        "tok/s, req/s",
        "hit ",
        "verified ",
        "reset ",
    ):
        assert f"\n  {column}" in legend, (column, legend)
    assert "usage.cached_tokens / prompt_tokens" in legend, legend
    rows = final_table(stdout)
    assert [row[:3] for row in rows] == [["1", "2", "0"], ["2", "2", "0"]], rows
    assert [row[-3:] for row in rows] == [
        ["cold", "epoch", str(epoch + 2)],
        ["cold", "epoch", str(epoch + 3)],
    ], rows
    assert [float(row[-6]) for row in rows] == [round(r["cache_hit_rate_usage"], 2) for r in runs], rows
    assert [row[-5:-3] for row in rows] == [["-", "-"]] * 2  # no --warm: no warm-up, no prediction


def test_bench_warm_resets_warms_proves_and_predicts(server: Server, tmp_path: Path) -> None:
    """--warm FILE: reset, then the warm set sent twice and proven warm, then the run; the run reports the
    share of its prompt tokens the warm set covers, and its hit rate reaches it."""
    warm = ROOT / "examples" / "bench-warm.yaml"  # docs/warmup.md's command, as written
    epoch = server.cache()["epoch"]
    rc, report, stdout = run_bench(server.url, tmp_path, "--warm", str(warm))
    assert rc == 0, stdout
    runs = report["runs"]
    assert [r["reset"]["epoch"] for r in runs] == [epoch + 2, epoch + 3]  # still reset before each
    assert [r["warm"]["verified"] for r in runs] == ["warm", "warm"], runs
    for r in runs:
        # the system prompt's full blocks: most of each prompt, not all of it (the question differs)
        assert 0.5 < r["warm_predicted_hit_rate"] < 1, r
        assert r["cache_hit_rate_usage"] >= r["warm_predicted_hit_rate"] - 0.01, r
    assert "then warmed with 1 prompts, each proven warm" in stdout, stdout
    assert [row[-5] for row in final_table(stdout)] == ["warm", "warm"], stdout

    bad = tmp_path / "bad.yaml"
    bad.write_text("[{prompt: ''}]")
    for extra in (("--warm", str(bad)), ("--warm", str(warm), "--no-reset"), ("--warm-pin",)):
        proc_rc, _, _ = run_bench(server.url, tmp_path, *extra)
        assert proc_rc == 2, extra


def test_bench_without_the_admin_token_says_the_reset_was_refused(server: Server, tmp_path: Path) -> None:
    rc, report, stdout = run_bench(server.url, tmp_path, token=None)
    assert rc == 0  # the load itself ran
    assert all(r["reset"]["result"] == "Failed" and r["reset"]["http_status"] == 401 for r in report["runs"])
    # The canary was sent, but never checked: the reset did not happen.
    assert all(r["reset"]["verified"] is None for r in report["runs"]), report["runs"]
    assert [row[-4:] for row in final_table(stdout)] == [["-", "refused", "(HTTP", "401)"]] * 2, stdout


def test_bench_no_reset_leaves_the_cache_alone(server: Server, tmp_path: Path) -> None:
    epoch = server.cache()["epoch"]
    rc, report, stdout = run_bench(server.url, tmp_path, "--no-reset")
    assert rc == 0
    assert all(r["reset"] is None for r in report["runs"])
    assert server.cache()["epoch"] == epoch
    assert "prefix cache not reset (--no-reset)" in stdout and "reset before each run" not in stdout, stdout
    assert [row[-2:] for row in final_table(stdout)] == [["-", "-"]] * 2, stdout


def test_bench_no_verify_resets_without_a_canary(server: Server, tmp_path: Path) -> None:
    epoch = server.cache()["epoch"]
    rc, report, stdout = run_bench(server.url, tmp_path, "--no-verify")
    assert rc == 0
    assert [r["reset"]["epoch"] for r in report["runs"]] == [epoch + 2, epoch + 3]
    assert all(r["reset"]["verified"] is None for r in report["runs"]), report["runs"]
    assert "(not verified, --no-verify)" in stdout, stdout
    assert [row[-3] for row in final_table(stdout)] == ["-", "-"], stdout


def test_bench_resets_a_vllm_server_its_own_way_and_verifies_it(tmp_path: Path) -> None:
    """`--engine vllm` against the vLLM stand-in with a CPU offload tier: reset_external=true is sent, so
    the tier is cleared and the canary finds the server cold."""
    from support.engine_standin import start_standin
    from support.procs import stop

    vllm = start_standin(tmp_path, "vllm")
    try:
        vllm.set(offload=True)
        rc, report, stdout = run_bench(vllm.url, tmp_path, "--engine", "vllm")
        assert rc == 0, stdout
        runs = report["runs"]
        assert [r["reset"]["verified"] for r in runs] == ["cold", "cold"], runs
        assert all(r["reset"]["cleared"] == ["pool", "external"] for r in runs), runs
        assert [row[-2:] for row in final_table(stdout)] == [["cold", "ok"]] * 2, stdout
        assert vllm.state()["resets"] == 3  # the warm-up's and each run's
    finally:
        stop(vllm.proc, grace=5)


def test_bench_reads_a_servers_replies_with_a_cap() -> None:
    """The server under test is not trusted: an endless /prefix_cache or /tokenize body is read up to
    SERVER_REPLY_BYTES, then the reply is a short error, not a process that grows until it is killed."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from kvpilot.cli.loadgen import SERVER_REPLY_BYTES, get_json
    from support.hostile_pod import endless_json
    from support.procs import free_port

    async def go() -> tuple[int, object]:
        app = web.Application()
        app.router.add_post("/tokenize", endless_json(b'{"tokens": ['))
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{port}/tokenize"
                return await asyncio.wait_for(get_json(session, "POST", url, {"prompt": "x"}), 30)
        finally:
            await runner.cleanup()

    assert asyncio.run(go()) == (200, f"a reply over {SERVER_REPLY_BYTES} bytes")
