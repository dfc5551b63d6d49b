"""One PrefixCacheReset over 5,000 stand-in pods through the real API server: it succeeds and its status stays
small. Runs bench/fanout.py (its own control plane) and checks what it reports, not how fast it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]


def test_reset_of_5000_pods_succeeds_with_a_bounded_status(tmp_path: Path) -> None:
    out = tmp_path / "fanout.json"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "fanout.py"),
            "--pods",
            "5000",
            "--reply-delay-ms",
            "0",
            "--no-sequential",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=850,
        env={
            **os.environ,
            "TMPDIR": str(tmp_path),
        },  # the bench's work folder (its control plane) goes with it
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (round_,) = json.loads(out.read_text())["rounds"]
    assert (round_["phase"], round_["targets"], round_["succeeded"]) == ("Succeeded", 5000, 5000), round_
    assert round_["status_pod_entries"] == 100 and round_["status_bytes"] < 64 * 1024, round_
