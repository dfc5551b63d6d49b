"""bench/router_cost.py, run small: both routers round-robin and by prefix (kvpilot's fed by the stubs' KV
events), each phase answered, and the ratios written to its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.vllm_client import tools_bin

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(600)


def test_router_cost_quick(tmp_path: Path) -> None:
    out = tmp_path / "router-cost.json"
    argv = [sys.executable, str(ROOT / "bench" / "router_cost.py"), "--chats", "60", "--completions", "60"]
    argv += ["--streams", "4", "--chunks", "8", "--repeats", "1", "--out", str(out)]
    argv += ["--sglang-router", tools_bin("sglang-router")]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=500, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    for policy in ("round_robin", "prefix"):
        for phase in ("chats", "completions", "streams"):
            row = doc["summary"][policy][phase]
            assert row["kvpilot"] > 0 and row["sglang_router"] > 0 and row["ratio"] > 0, (policy, phase, row)
    assert {(run["router"], run["policy"]) for run in doc["runs"]} == {
        (router, policy) for router in ("kvpilot", "sglang-router") for policy in ("round_robin", "prefix")
    }
    for run in doc["runs"]:
        for phase in ("chats", "completions", "streams"):
            assert run[phase]["failures"] == 0, run
        if run["router"] == "kvpilot" and run["policy"] == "prefix":
            # routed by the prefixes the stubs' KV events named, and the predictions held
            routing = run["routing"]
            assert routing["decisions_prefix"] > 0 and routing["predicted_cached_tokens"] > 0, routing
            assert routing["predicted_cached_tokens"] <= routing["reported_cached_tokens"], routing
    assert doc["summary"]["chats"] == doc["summary"]["round_robin"]["chats"]  # the earlier layout's keys
