"""The project's own CPU kernels in C: built from their embedded source with the system's C compiler at first
use (as inductor builds its CPU kernels), or ahead of time (`python -m kvpilot.kernels.prebuild`: the image
does, with a compiler it does not keep), cached, and loaded with ctypes.

Each kernel module (kernels/panel_gemm.py, kernels/cpu_attention.py, kernels/cpu_elementwise.py) holds its
C source and asks `library` for it. They are written for x86-64 with AVX2 and FMA; without those `library`
answers None and the caller takes its torch path. A library is kept once per source and flags in
`$KVPILOT_CACHE/kernels/<name>-<hash>.so`, and loaded from there wherever it is, so a process needs a C
compiler (`$CC`, else `cc` or `gcc`) only to build one that is not there yet: written to a temporary file,
then renamed, so processes starting together never load half of one. ctypes releases the interpreter's
lock for the call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvpilot.default_model import cache_root

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 120


# A C function's (argument types, result type or None), as ctypes declares them.
Signature = tuple[tuple[type, ...], type | None]


@functools.cache
def library(name: str, source: str, **functions: Signature) -> ctypes.CDLL | None:
    """The kernel `name` built from `source` and loaded, its `functions` declared with their signatures, or
    None where it cannot run here (said once, in the log)."""
    lib = _load(name, source)
    if lib is not None:
        for function, (arguments, result) in functions.items():
            getattr(lib, function).argtypes = arguments
            getattr(lib, function).restype = result
    return lib


def _load(name: str, source: str) -> ctypes.CDLL | None:
    if platform.machine() != "x86_64" or not _cpu_has("avx2", "fma"):
        return None
    path = library_path(name, source)
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:  # not built yet, or left damaged (a full disk, a copied cache), or unreadable
        if os.path.lexists(path):  # (lexists: never raises, as a cache we may not read could)
            log.warning("%s: cannot load %s (%s)", name, path, exc)
    compiler = _compiler()
    if not compiler:
        log.info(
            "%s: not built, and no C compiler (cc, gcc or $CC) to build it: its torch path is used", name
        )
        return None
    try:
        build(name, source, compiler)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("%s: cannot build or load the kernel (%s): its torch path is used", name, exc)
        return None


def library_path(name: str, source: str) -> Path:
    """Where the library `name` built from `source` is kept: named by a hash of the source and flags (the
    compiler that built it does not matter: any C compiler's build of them serves)."""
    key = hashlib.sha256(" ".join((source, *FLAGS)).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"{name}-{key}.so"


def _compiler() -> list[str]:
    """$CC as make reads it (a command, perhaps with arguments: "ccache gcc"), else cc or gcc; [] for none."""
    found = shutil.which("cc") or shutil.which("gcc")
    return shlex.split(os.environ.get("CC", "")) or ([found] if found else [])


def build(name: str, source: str, compiler: list[str] | None = None) -> Path:
    """Build the library `name` from `source` into `library_path` (whatever this machine's CPU: AVX2 and FMA
    are only needed where it is loaded); raises OSError where it cannot (no compiler, a failed build)."""
    compiler = compiler or _compiler()
    if not compiler:
        raise OSError("no C compiler (cc, gcc or $CC)")
    path = library_path(name, source)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, lib = Path(tmp) / f"{name}.c", Path(tmp) / path.name
        src.write_text(source)
        done = subprocess.run(
            [*compiler, *FLAGS, "-o", str(lib), str(src)],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            raise OSError(f"{' '.join(compiler)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
        os.replace(lib, path)  # atomic: another process loads a whole library or builds its own
    log.info("%s: kernel built with %s into %s", name, " ".join(compiler), path)
    return path


def _cpu_has(*flags: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return all(flag in have for flag in flags)
    except OSError:
        pass
    return False
