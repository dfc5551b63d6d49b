"""bench/router_loads.py, run small: kvpilot's prefix-aware router and the real sglang-router's cache_aware
on two generated loads over the same stub pods (KV events, LRU pools, a modelled prefill), each request
answered, both routers given the same prompts, and the comparison written to its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.vllm_client import tools_bin

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(600)


def test_router_loads_quick(tmp_path: Path) -> None:
    out = tmp_path / "router-loads.json"
    argv = [sys.executable, str(ROOT / "bench" / "router_loads.py"), "--members", "2", "--requests", "60"]
    argv += ["--repeats", "2"]
    argv += ["--seed", "7", "--out", str(out), "--sglang-router", tools_bin("sglang-router")]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=500, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["summary"]["members"] == len(doc["members"]) == 2
    for member in doc["members"]:
        ours, theirs = member["kvpilot"][0], member["sglang-router"][0]
        assert ours["failures"] == theirs["failures"] == 0, member
        # the same prompts through each router, cached where the pods said so
        assert ours["prompt_tokens"] == theirs["prompt_tokens"] > 0, member
        assert 0 <= ours["hit_share"] <= 1 and 0 <= theirs["hit_share"] <= 1, member
        assert member["hit_share_ratio"] is not None and member["ttft_p50_ratio"] > 0, member
        assert 2 <= member["member"]["pods"] <= 4, member["member"]
        # two runs of each router: the member's noise, and whether kvpilot trails beyond it
        assert len(member["kvpilot"]) == len(member["sglang-router"]) == 2, member
        for label in ("hit_share", "ttft_p50"):
            assert member[label + "_noise"] >= 0, member
            behind = member[f"kvpilot_{label}_behind_beyond_noise"]
            assert behind is (
                abs(member[label + "_ratio"] - 1) > member[label + "_noise"]
                and (member[label + "_ratio"] < 1 if label == "hit_share" else member[label + "_ratio"] > 1)
            ), member
    summary = doc["summary"]
    assert summary["hit_share_ratio_geomean"] > 0 and summary["ttft_p50_ratio_geomean"] > 0, summary
    assert 0 <= summary["kvpilot_hit_share_behind_beyond_noise"] <= 2, summary
