"""bench/decode_matmul.py, run small and as docs/performance.md writes it (a file, in a shell without
PYTHONSAFEPATH): every kernel's product checked against F.linear's (the bench exits non-zero otherwise),
each timed, its speed-up written to the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


def test_decode_matmul_quick(tmp_path: Path) -> None:
    out = tmp_path / "decode-matmul.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    argv = [sys.executable, "bench/decode_matmul.py", "--rows", "1", "8", "--layers", "2", "--repeats", "2"]
    r = subprocess.run(
        [*argv, "--out", str(out)], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["kernels"], "no packed kernel ran: the machine CI runs on has oneDNN at least"
    assert set(doc["rows"]) == {"1", "8"}
    for row in doc["rows"].values():
        assert row["F.linear"]["ms"] > 0
        for kernel in doc["kernels"]:
            assert row[kernel]["gb_per_s"] > 0 and row[f"{kernel}_speedup"] > 0, (kernel, row)
