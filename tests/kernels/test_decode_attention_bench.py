"""bench/decode_attention.py, run small and as docs/performance.md writes it (a file, in a shell without
PYTHONSAFEPATH): the C kernel's attention checked against the reference's (the bench exits non-zero
otherwise), each timed, the speed-up written to the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.kernels import cpu_attention

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not cpu_attention.available(), reason="no AVX2/FMA or no C compiler here"),
]


def test_decode_attention_quick(tmp_path: Path) -> None:
    out = tmp_path / "decode-attention.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    argv = [
        sys.executable,
        "bench/decode_attention.py",
        "--batches",
        "1",
        "8",
        "--layers",
        "2",
        "--repeats",
        "2",
    ]
    r = subprocess.run(
        [*argv, "--out", str(out)], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc["batches"]) == {"1", "8"} and doc["layers"] == 2
    for row in doc["batches"].values():
        assert row["reference"]["ms"] > 0 and row["kernel"]["ms"] > 0 and row["speedup"] > 0, row
