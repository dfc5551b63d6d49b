"""bench/serve.py --vs-bound at a size a test affords: the daemon, the engine in process and the torch decode
bound (bench/torch_bound.py) run the same load, and the bound computes what the daemon computes (same token
ids as the engine, same texts and token counts as the daemon). Checks what it reports, not how fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_vs_bound_smoke(tmp_path: Path) -> None:
    out = tmp_path / "vs-bound.json"
    # TMPDIR: the bench's log folder goes with the test's tmp_path
    env = {**os.environ, "PYTHONSAFEPATH": "1", "TMPDIR": str(tmp_path)}
    argv = [sys.executable, str(ROOT / "bench" / "serve.py"), "--vs-bound", "--requests", "4"]
    argv += ["--max-tokens", "6", "--rounds", "1", "--cpu-threads", "1", "--output", str(out)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=850, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["bound_same_token_ids_as_engine"], doc["runs"]
    assert doc["bound_same_texts_as_daemon"] and doc["bound_same_completion_tokens_as_daemon"], doc["runs"]
    assert doc["load"]["shared_prefix_tokens"] > 200, doc["load"]  # the system prompt, computed once
    for side in ("kvpilot_http", "engine_in_process", "torch_bound"):
        (run,) = doc["runs"][side]
        assert 4 <= run["output_tokens"] <= 24 and run["tokens_per_s"] > 0, (side, run)
    phases = doc["median_engine_phase_seconds"]
    assert phases["model"] > 0 and phases["scheduler"] > 0 and phases["sampling"] > 0, phases
    assert doc["ratio_kvpilot_http_vs_bound"] > 0, doc
