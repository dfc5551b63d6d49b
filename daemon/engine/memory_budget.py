"""How many bytes of host memory this process may still take: the kernel's MemAvailable, capped by what its
cgroup's memory limit leaves.

A container's limit is not in /proc/meminfo, which shows the host's: a pod limited to 8 GiB on a 512 GiB node
would see hundreds of GiB free and be OOM-killed staging a checkpoint. The limit is cgroup v2's `memory.max`
less `memory.current`, or cgroup v1's `memory/memory.limit_in_bytes` less `memory/memory.usage_in_bytes`
(v1 writes "no limit" as a number near 2**63, which min() makes harmless).
"""

from __future__ import annotations

from pathlib import Path

from kvpilot.daemon.engine.cpu_budget import CGROUP_ROOT

MEMINFO = Path("/proc/meminfo")
UNKNOWN = 1 << 62  # nothing readable: no cap from here


def host_memory_available(cgroup_root: Path = CGROUP_ROOT, meminfo: Path = MEMINFO) -> int:
    """min(MemAvailable, the cgroup's limit minus its usage); UNKNOWN when neither can be read."""
    available = UNKNOWN
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    left = cgroup_memory_left(cgroup_root)
    return available if left is None else min(available, left)


def cgroup_memory_left(root: Path = CGROUP_ROOT) -> int | None:
    """Bytes the cgroup's limit leaves (0 at or past it), or None when unlimited or unknown."""
    for limit_file, usage_file in (
        (root / "memory.max", root / "memory.current"),  # v2
        (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes"),  # v1
    ):
        try:
            limit = limit_file.read_text().strip()
            if limit == "max":
                return None
            return max(0, int(limit) - int(usage_file.read_text()))
        except (OSError, ValueError):
            continue
    return None
