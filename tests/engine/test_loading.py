"""What the engine takes from its surroundings: CPU threads from affinity and the cgroup quota, EOS ids
from generation_config.json."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.daemon.engine.cpu_budget import available_cpus, cgroup_cpu_quota, engine_threads


def cgroup(tmp_path: Path, v2: str | None = None, v1: tuple[str, str] | None = None) -> Path:
    tmp_path.mkdir()
    if v2 is not None:
        (tmp_path / "cpu.max").write_text(v2 + "\n")
    if v1 is not None:
        (tmp_path / "cpu").mkdir()
        (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(v1[0])
        (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(v1[1])
    return tmp_path


def test_cgroup_quota_v2_and_v1(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(cgroup(tmp_path / "a", v2="250000 100000")) == 2.5
    assert cgroup_cpu_quota(cgroup(tmp_path / "b", v2="max 100000")) is None
    assert cgroup_cpu_quota(cgroup(tmp_path / "c", v1=("150000", "100000"))) == 1.5
    assert cgroup_cpu_quota(cgroup(tmp_path / "d", v1=("-1", "100000"))) is None
    assert cgroup_cpu_quota(tmp_path / "missing") is None


def test_threads_follow_the_quota_and_the_affinity(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    one_cpu = cgroup(tmp_path / "a", v2="100000 100000")
    assert available_cpus(one_cpu) == 1 and engine_threads(None, one_cpu) == 1
    wide = cgroup(tmp_path / "b", v2="6400000 100000")  # 64 CPUs of quota: the affinity mask decides
    assert available_cpus(wide) == affinity
    assert engine_threads(None, wide) == max(1, affinity - 1)
    assert engine_threads(3, one_cpu) == 3  # --cpu-threads wins


@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset (util-linux) is not installed")
def test_affinity_of_a_real_process() -> None:
    code = "from kvpilot.daemon.engine.cpu_budget import available_cpus; print(available_cpus())"
    out = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_eos_ids_include_generation_config(tmp_path: Path, default_model_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from kvpilot.daemon.engine.loader import eos_token_ids

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    cfg = AutoConfig.from_pretrained(default_model_dir)
    base = eos_token_ids(tmp_path, cfg, tok)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 11]}))
    assert eos_token_ids(tmp_path, cfg, tok) == base | {7, 11}
