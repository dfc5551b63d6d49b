"""How many CPUs this process may really use: its affinity mask and its cgroup's CPU quota.

`os.cpu_count()` reports the host's cores: 64 in a pod limited to 4 CPUs, whose 63 OpenMP threads then
spin-wait each other into a many times slower step. A container's limit shows up as the cgroup quota
(v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`); `taskset` and cpusets as the affinity mask.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def available_cpus(cgroup_root: Path = CGROUP_ROOT) -> int:
    """min(CPUs in the affinity mask, the cgroup quota rounded up); at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup may use per period, or None when unlimited or unknown."""
    try:
        v2 = (root / "cpu.max").read_text().split()
    except OSError:
        v2 = None
    if v2:
        if v2[0] == "max" or len(v2) < 2:
            return None
        return _ratio(v2[0], v2[1])
    try:
        quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
        period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return None if quota.startswith("-") else _ratio(quota, period)


def engine_threads(requested: int | None, cgroup_root: Path = CGROUP_ROOT) -> int:
    """torch threads for a CPU engine: as asked, else all usable CPUs but one (left to the HTTP server
    and the tokenizer pool)."""
    if requested is not None:
        return requested
    return max(1, available_cpus(cgroup_root) - 1)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None
