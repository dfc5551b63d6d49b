"""bench/weights.py --quick runs through: a swap in each pause mode and a restart under streaming chats, the
daemon's phase metrics read, and no response mixing versions. Checks what it reports, not how fast it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_weights_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "weights.json"
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    argv = [sys.executable, str(ROOT / "bench" / "weights.py"), "--quick", "--output", str(out)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=850, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["mixed_version_responses"]["count"] == 0, doc["mixed_version_responses"]
    assert [u["mode"] for u in doc["updates"]] == ["keep", "wait", "abort", "restart"]
    for u in doc["updates"][:3]:
        assert u["daemon_s"]["finish"] > 0 and u["daemon_s"]["update"] > 0, u
    assert doc["updates"][-1]["fleet_gap_s"] > 0 and doc["load"]["tokens"] > 0, doc
