"""The kernels also compile natively (to CUDA cubins for sm_80 and sm_90, with the ptxas triton ships),
specialised the way a real launch specialises them, and the attention kernel does not spill registers:
what the interpreter alone cannot show. Runs in a subprocess because this process interprets triton."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("native_compile_check.py")
TESTS = Path(__file__).resolve().parents[1]  # the script imports support.kernel_cases


@pytest.mark.parametrize("sm", [80, 90])
def test_kernels_compile_natively(sm):
    pytest.importorskip("triton.backends.nvidia", reason="this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(TESTS)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(sm), "--quick"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    assert proc.returncode == 0 and lines and all(line.startswith("ok") for line in lines), (
        proc.stdout[-4000:] + proc.stderr[-4000:]
    )
    assert any("_merge_splits_kernel" in line for line in lines)
