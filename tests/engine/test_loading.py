"""What the engine takes from its surroundings: CPU threads from affinity and the cgroup quota, host memory
from MemAvailable and the cgroup limit, EOS ids from generation_config.json."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.daemon.engine.cpu_budget import available_cpus, cgroup_cpu_quota, engine_threads
from kvpilot.daemon.engine.memory_budget import UNKNOWN, cgroup_memory_left, host_memory_available


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


def test_host_memory_is_capped_by_the_cgroup_limit_v2_and_v1(tmp_path: Path) -> None:
    def tree(name: str, files: dict[str, str]) -> Path:
        root = tmp_path / name
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        return root

    gib = 1 << 30
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {512 * gib // 1024} kB\nMemAvailable: {400 * gib // 1024} kB\n")
    v2 = tree("v2", {"memory.max": f"{8 * gib}\n", "memory.current": f"{3 * gib}\n"})
    v1 = tree(
        "v1", {"memory/memory.limit_in_bytes": f"{8 * gib}\n", "memory/memory.usage_in_bytes": f"{6 * gib}\n"}
    )
    v1_unlimited = tree(
        "v1u",
        {"memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "1\n"},
    )
    v2_unlimited = tree(
        "v2u", {"memory.max": "max\n", "memory.current": "1\n", "memory/memory.limit_in_bytes": "1\n"}
    )
    over = tree("over", {"memory.max": "100\n", "memory.current": "200\n"})
    assert host_memory_available(v2, meminfo) == 5 * gib  # a pod's limit, not the node's 400 GiB free
    assert host_memory_available(v1, meminfo) == 2 * gib
    assert host_memory_available(v1_unlimited, meminfo) == 400 * gib
    assert cgroup_memory_left(v2_unlimited) is None  # v2 says unlimited: v1 files are not consulted
    assert cgroup_memory_left(over) == 0
    assert cgroup_memory_left(tmp_path / "none") is None
    assert host_memory_available(tmp_path / "none", tmp_path / "no-meminfo") == UNKNOWN


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
