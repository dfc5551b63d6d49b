"""kernels/native.py's libraries built ahead of time, as the image builds them: `python -m
kvpilot.kernels.prebuild` into a $KVPILOT_CACHE, then each kernel module loads its library from there in a
process that has no C compiler (none on PATH, no $CC); with nothing built there, the same process takes
the torch path and says why. Each run is a fresh interpreter (the libraries are looked up once a process)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.kernels import native
from kvpilot.kernels.prebuild import LIBRARIES

pytestmark = pytest.mark.skipif(
    not (platform.machine() == "x86_64" and native._cpu_has("avx2", "fma")),
    reason="the C kernels run on x86-64 with AVX2 and FMA",
)

LOADS = (
    "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
    "from kvpilot.kernels import panel_gemm, cpu_attention, cpu_elementwise\n"
    "print('LOADED', [m._library() is not None for m in (panel_gemm, cpu_attention, cpu_elementwise)])\n"
)


def _python(cache: Path, *args: str, compiler: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "PATH")}
    env["KVPILOT_CACHE"] = str(cache)
    env["PATH"] = os.environ["PATH"] if compiler else str(cache / "no-such-bin")
    # -P, from outside the checkout: its kernels/ would shadow the installed package's name (as a user runs it)
    return subprocess.run(
        [sys.executable, "-P", *args], cwd=cache, env=env, capture_output=True, text=True, timeout=300
    )


def test_prebuilt_kernels_load_without_a_compiler(tmp_path: Path) -> None:
    if native._compiler() == []:
        pytest.skip("no C compiler to prebuild with")
    built = _python(tmp_path, "-m", "kvpilot.kernels.prebuild", compiler=True)
    assert built.returncode == 0, built.stderr
    paths = [Path(line) for line in built.stdout.split()]
    assert [p.name.split("-")[0] for p in paths] == list(LIBRARIES)
    assert all(p.is_file() and p.parent == tmp_path / "kernels" for p in paths)

    loaded = _python(tmp_path, "-c", LOADS, compiler=False)
    assert loaded.returncode == 0, loaded.stderr
    assert "LOADED [True, True, True]" in loaded.stdout, loaded.stdout
    assert "no C compiler" not in loaded.stdout and "kernel built" not in loaded.stdout
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == sorted(p.name for p in paths)


def test_without_a_library_or_a_compiler_the_torch_path_is_taken(tmp_path: Path) -> None:
    loaded = _python(tmp_path, "-c", LOADS, compiler=False)
    assert loaded.returncode == 0, loaded.stderr
    assert "LOADED [False, False, False]" in loaded.stdout
    assert "no C compiler (cc, gcc or $CC) to build it: its torch path is used" in loaded.stdout


def test_the_prebuild_names_each_modules_own_source() -> None:
    from kvpilot.kernels import cpu_attention, cpu_elementwise, panel_gemm

    for module in (panel_gemm, cpu_attention, cpu_elementwise):
        name = module.__name__.rsplit(".", 1)[1]
        assert LIBRARIES[name] is module.SOURCE
        # what its _library() asks native.library for
        assert re.search(rf'native\.library\(\s*"{name}",\s*SOURCE\b', Path(module.__file__).read_text())
