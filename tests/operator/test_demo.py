"""`make demo`, as the README's third command writes it, in a shell without the venv on PATH: its own dev cluster,
the operator, two real daemons and their router; every step's output is what the README promises."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from support import ROOT

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]


def cached(line: str) -> list[int]:
    return [int(n) for n in re.findall(r"cached (\d+)", line)]


def test_make_demo_as_the_readme_writes_it() -> None:
    assert "make demo" in (ROOT / "README.md").read_text()
    venv_bin = str(ROOT / ".venv" / "bin")
    path = os.pathsep.join(
        p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep) if p != venv_bin
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "KUBECONFIG", "PYTHONPATH")}
    r = subprocess.run(
        ["make", "demo"], cwd=ROOT, env={**env, "PATH": path}, capture_output=True, text=True, timeout=840
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    warm = [ln for ln in out.splitlines() if ln.startswith("pod ") and "->" in ln]
    assert len(warm) == 2 and all(cached(ln)[0] == 0 and cached(ln)[1] > 0 for ln in warm), out
    assert "phase Succeeded: 2/2 pods reset" in out
    cold = [ln for ln in out.splitlines() if ln.startswith("pod ") and "->" not in ln]
    assert len(cold) == 2 and all(cached(ln) == [0] for ln in cold), out
    assert re.search(r"status\.endpoint: http://llm-router\.default\.svc:8080", out), out
    routed = next(ln for ln in out.splitlines() if ln.startswith("router ") and "->" in ln)
    first, second = cached(routed)
    assert second > first, routed  # the repeat went to the pod that cached the first request
    assert "success: True" in out and len(re.findall(r"success True, epoch 2", out)) == 2, out
    after = next(ln for ln in out.splitlines() if ln.startswith("router ") and "cold again" in ln)
    assert cached(after) == [0], after
    assert "tearing down" in out
