"""bench/router_loads.py, run small: kvpilot's prefix-aware router and the real sglang-router's cache_aware
on two generated loads over the same stub pods (KV events, LRU pools, a modelled prefill), each request
answered, both routers given the same prompts, and the comparison written to its JSON."""

from __future__ import annotations

import json
import math
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
        for label, worse in (("hit_share", -1), ("ttft_p50", 1)):
            noise, ratio = member[label + "_noise"], member[label + "_ratio"]
            assert noise is not None and noise >= 0, member
            # behind: worse than level by more than the noise, both as written (3 decimals)
            assert member[f"kvpilot_{label}_behind_beyond_noise"] is (round(worse * (ratio - 1), 3) > noise)
    summary = doc["summary"]
    for label in ("hit_share", "ttft_p50"):
        ratios = summary[label + "_ratios"]
        geomean = math.prod(ratios) ** (1 / len(ratios))
        assert summary[label + "_ratio_geomean"] == pytest.approx(geomean, abs=1e-4), summary
        behind = sum(m[f"kvpilot_{label}_behind_beyond_noise"] for m in doc["members"])
        assert summary[f"kvpilot_{label}_behind_beyond_noise"] == behind, summary
