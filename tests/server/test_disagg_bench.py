"""bench/disagg.py --quick as a user runs it: two colocated daemons behind the router, then a prefill and a
decode daemon behind the router's P/D mode, each pinned to a core, the same streamed load on both. Checks
that the JSON carries every figure (and that the P/D run really moved KV), not how fast anything was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FIGURES = ("itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "output_tokens_per_s")


def test_disagg_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "disagg.json"
    # TMPDIR: the bench's work folder (the daemons' and routers' logs) goes with the test's tmp_path
    env = {**os.environ, "PYTHONSAFEPATH": "1", "TMPDIR": str(tmp_path)}
    env.pop("KVPILOT_ADMIN_TOKEN", None)
    argv = [sys.executable, str(ROOT / "bench" / "disagg.py"), "--quick", "--out", str(out)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=850, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "colocated" in r.stdout and "KV transfer" in r.stdout, r.stdout  # the text summary
    doc = json.loads(out.read_text())
    assert (
        doc["bench"] == "disagg" and doc["config"]["quick"] is True and len(doc["load_average_before"]) == 3
    )
    assert set(doc["runs"]) == {"colocated", "pd"}, doc["runs"]
    for mode, run in doc["runs"].items():
        assert run["errors"] == 0 and run["requests"] == doc["workload"]["requests"], (mode, run)
        assert run["output_tokens"] == run["requests"] * doc["workload"]["max_tokens"], (mode, run)
        for key in FIGURES:
            assert isinstance(run[key], float), (mode, key, run)
        assert run["prompt_tokens"]["min"] >= 300, run["prompt_tokens"]  # long prompts
        assert run["pinned_cores"] and len(run["pinned_cores"]) == 2, run
    assert len(doc["runs"]["colocated"]["requests_per_pod"]) >= 1
    kv = doc["runs"]["pd"]["kv_transfer"]
    assert kv["pulls"] >= 1 and kv["bytes_received"] > 0 and kv["failures"] == {}, kv
    assert kv["blocks_received"] == kv["blocks_sent_by_prefill_pod"] > 0, kv
    assert kv["held_blocks"] == kv["blocks_received"] + kv["blocks_reused_on_decode_pod"], kv
    assert kv["bandwidth_gbit_s"] > 0 and kv["socket_copy"]["bandwidth_gbit_s"] > 0, kv
    assert kv["socket_copy"]["bytes"] <= kv["bytes_received"] and kv["bandwidth_over_socket_copy"] > 0, kv
    assert doc["runs"]["pd"]["router_pd_requests"]["transferred"] == doc["workload"]["requests"]
    assert set(doc["ratios"]) == {
        "itl_p50_colocated_over_pd",
        "itl_p99_colocated_over_pd",
        "ttft_p50_pd_over_colocated",
        "ttft_p99_pd_over_colocated",
        "output_tokens_per_s_pd_over_colocated",
        "kv_transfer_over_socket_copy",
    }
    assert all(isinstance(v, float) and v > 0 for v in doc["ratios"].values()), doc["ratios"]
