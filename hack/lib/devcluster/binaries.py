"""Finds (and, when asked, builds) the control-plane binaries.

The binaries come from hack/cluster/build.sh, which compiles them from pinned
Go modules into a cache folder keyed by version. Python never guesses that
folder: it asks the script (`--print-bindir`), so there is one source of truth.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]  # hack/lib/devcluster/binaries.py
BUILD_SCRIPT = REPO_ROOT / "hack" / "cluster" / "build.sh"
BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kube-proxy",
    "crictl",
)


class BinariesMissing(RuntimeError):
    """The control-plane binaries are not built and building was not allowed."""


def bin_dir() -> Path:
    """The cache folder build.sh writes to (it may not exist yet)."""
    env_dir = os.environ.get("KVPILOT_K8S_BIN_DIR")
    if env_dir:  # lets a user point at binaries built elsewhere
        return Path(env_dir)
    out = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--print-bindir"], check=True, capture_output=True, text=True
    )
    return Path(out.stdout.strip())


def missing(directory: Path) -> list[str]:
    """Names of the binaries absent from `directory`."""
    return [b for b in BINARIES if not os.access(directory / b, os.X_OK)]


def ensure_binaries(build: bool = True) -> Path:
    """Return the folder holding all binaries, running build.sh first if `build`.

    build.sh is a no-op in well under a second when its inputs are unchanged,
    so calling it every time keeps the binaries in step with go.mod.
    """
    if build and not os.environ.get("KVPILOT_K8S_BIN_DIR"):
        subprocess.run(["bash", str(BUILD_SCRIPT)], check=True)
    directory = bin_dir()
    absent = missing(directory)
    if absent:
        raise BinariesMissing(
            f"{', '.join(absent)} not found in {directory}; run `bash hack/cluster/build.sh`"
        )
    return directory
