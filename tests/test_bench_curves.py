"""bench/curves.py --quick runs through and writes, per curve, a JSON with its points and baseline and a PNG
plot. Checks what it reports (sizes, cached tokens, every series plotted), not how fast anything was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import benchkit
from support import ROOT

CURVES = benchkit.bench_module(ROOT / "bench" / "curves.py")


def run_quick(out: Path, *only: str) -> dict[str, dict]:
    # TMPDIR: the work folders the bench and the benches it runs keep (logs) go with the test's tmp_path
    env = {**os.environ, "PYTHONSAFEPATH": "1", "TMPDIR": str(out)}
    argv = [
        sys.executable,
        str(ROOT / "bench" / "curves.py"),
        "--quick",
        "--out-dir",
        str(out),
        "--only",
        *only,
    ]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=800, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    docs = {}
    for name in only:
        doc = json.loads((out / f"{name}.json").read_text())
        png = (out / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000, name
        assert doc["quick"] is True and len(doc["load_average_before"]) == 3, doc
        assert any(s["baseline"] for s in doc["series"].values()), f"{name}: no baseline series"
        for label, s in doc["series"].items():
            assert len(s["x"]) == len(s["y"]) >= 1, (name, label, s)
            assert all(y is not None and y >= 0 for y in s["y"]), (name, label, s)
        docs[name] = doc
    return docs


def test_loglog_fit_reads_the_exponent() -> None:
    xs = [1, 2, 4, 8, 16]
    assert CURVES.loglog_fit(xs, [3.0] * 5)["shape"] == "flat"
    assert CURVES.loglog_fit(xs, [5.0 * x for x in xs]) == {"exponent": 1.0, "shape": "linear", "points": 5}
    assert CURVES.loglog_fit(xs, [x * x / 7 for x in xs])["shape"] == "quadratic"
    assert CURVES.loglog_fit(xs, [x**0.5 for x in xs])["exponent"] == pytest.approx(0.5)
    assert CURVES.loglog_fit([4], [1.0]) is None  # one point: no slope


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_curves_quick_engine_server_reset_router(tmp_path: Path) -> None:
    docs = run_quick(tmp_path, "throughput", "ttft", "reset", "router")
    q = CURVES.QUICK
    tp = docs["throughput"]
    assert set(tp["series"]) == {"engine", "kvpilot serve (HTTP)", "transformers generate_batch"}
    for s in tp["series"].values():
        assert s["x"] == q["concurrency"] and all(y > 0 for y in s["y"]), s
    for point in tp["points"]:  # every request of every side produced its tokens
        c = point["concurrency"]
        assert point["engine"]["output_tokens"] == c * q["max_tokens"], point
        assert point["transformers"]["output_tokens"] == c * q["max_tokens"], point
        assert len(point["server"]["completion_tokens"]) == c, point
    ttft = docs["ttft"]
    for point in ttft["points"]:  # the cached case reuses all of the prompt but its new last 16 tokens
        assert point["cached_tokens"] == point["prompt_tokens"] - 16, point
    assert docs["reset"]["series"]["reset (swap the index)"]["x"] == q["cached_blocks"]
    assert [p["cached_blocks"] for p in docs["reset"]["points"]] == q["cached_blocks"]
    router = docs["router"]
    assert [p["pods"] for p in router["points"]] == q["fleet"]
    for point in router["points"]:
        assert {r["router"] for r in point["runs"]} == {"kvpilot", "sglang-router"}, point
        for run in point["runs"]:
            assert run["chats"]["failures"] == 0 and run["streams"]["failures"] == 0, run
            assert run["workers"] == point["pods"], run


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_curves_quick_fanout(tmp_path: Path) -> None:
    doc = run_quick(tmp_path, "fanout")["fanout"]
    pods = CURVES.QUICK["pods"]
    assert doc["series"]["fan-out, replies at once"]["x"] == pods
    assert doc["series"]["sequential loop, 20 ms replies"]["x"] == pods  # small: the 20 ms loop runs too
    for run in doc["runs"]:
        assert [r["phase"] for r in run["rounds"]] == ["Succeeded", "Succeeded"], run
        assert all(r["succeeded"] == run["pods"] for r in run["rounds"]), run
