"""vLLM's package (vllm 0.33.0 from PyPI, --no-deps) in its folder of the tools cache, for the tests that
run vLLM's own code against kvpilot: its weight-sync client (tests/weights/test_weight_client.py) and its
KV event structs (tests/router/test_kv_wire.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT


def vllm_client_dir() -> Path:
    """`make vllm-client` (vLLM's package, --no-deps, for this python); skipped, saying why, only when
    the install itself fails (no package index)."""
    r = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "vllm-client", f"VLLM_CLIENT_PYTHON={sys.executable}"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if r.returncode != 0 and "vllm-client: ERROR: pip install" in r.stderr:
        pytest.skip(f"vLLM's package could not be installed (make vllm-client): {r.stderr[-2000:]}")
    assert r.returncode == 0, r.stderr[-4000:]
    r = subprocess.run(
        ["bash", str(ROOT / "hack/tools/vllm-client/build.sh"), "--print-dir"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip())
