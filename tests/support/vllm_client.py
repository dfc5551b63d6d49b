"""vLLM's package (vllm 0.33.0 from PyPI, --no-deps) in its folder of the tools cache, for the tests that
run vLLM's own code against kvpilot: its weight-sync client (tests/weights/test_weight_client.py) and its
KV event structs (tests/router/test_kv_wire.py); and the pip-installed routers of the tools folder
(vllm-router, smg)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT


def built_tool_dir(tool: str, *make_vars: str, timeout: float = 900) -> Path:
    """`make TOOL` (one of hack/tools/*/build.sh; a no-op once made, as `make test` does first), then the
    folder its build script prints; skipped, saying why, only when the install itself fails (no package
    index)."""
    r = subprocess.run(
        ["make", "-s", "-C", str(ROOT), tool, *make_vars], capture_output=True, text=True, timeout=timeout
    )
    if r.returncode != 0 and f"{tool}: ERROR: pip install" in r.stderr:
        pytest.skip(f"{tool} could not be installed (make {tool}): {r.stderr[-2000:]}")
    assert r.returncode == 0, r.stderr[-4000:]
    r = subprocess.run(
        ["bash", str(ROOT / f"hack/tools/{tool}/build.sh"), "--print-dir"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip())


def tools_bin(name: str) -> str:
    """`make NAME` for a tool of hack/tools/build.sh (a no-op once `make tools` ran), its script in the
    tools folder."""
    r = subprocess.run(["make", "-s", "-C", str(ROOT), name], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    r = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "tools-bindir"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return str(Path(r.stdout.strip()) / name)


def vllm_client_dir() -> Path:
    """vLLM's package (--no-deps, for this python: `make vllm-client`)."""
    return built_tool_dir("vllm-client", f"VLLM_CLIENT_PYTHON={sys.executable}")
