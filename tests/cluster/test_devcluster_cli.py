"""`hack/cluster/devcluster.py up` where nodes of the real kubelet cannot run: one line that says why and what to
do, before anything is built or started. The euid is stood in for (tests run as root here); the
command itself is the real one, in this process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devcluster import cli


def test_up_without_root_says_why_and_the_way_out_before_building(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    built = []
    monkeypatch.setattr("devcluster.binaries.ensure_binaries", lambda *a: built.append(a))
    assert cli.main(["up", "--dir", str(tmp_path / "cluster")]) == 2
    err = capfd.readouterr().err
    assert "need root" in err and "run it as root" in err and len(err.strip().splitlines()) == 1, err
    assert built == [] and not (tmp_path / "cluster" / "pid").exists()
