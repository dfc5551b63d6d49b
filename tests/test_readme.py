"""README.md's shell blocks, top to bottom, as a new user types them: each block in a fresh `bash -euo pipefail`
without the venv on PATH, in a copy of the checkout with its own dev cluster.

The commands come from README.md itself. Two blocks are left out: the first (`make serve`, `make test`: CI
runs `make test`, and this test is part of it) and `make demo` (tests/operator/test_demo.py runs it as
written). The block that is only `make serve` is "shell 1": it keeps running in the background from its
ready line on, as the README says; the hand-run operator of the Kubernetes block keeps running through the
Helm block, whose `helm test` must pass with it still up. Each block's duration is printed and written to
`readme-blocks.json` in the test's tmp dir.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[1]
# Ports the README's commands bind on this machine: the daemon (8000), the hand-run operator (8080, 9090).
PORTS = {
    8000: "make serve",
    8080: "the hand-run operator's liveness",
    9090: "the hand-run operator's metrics",
}
READY = "ready: in another shell"
# What a user's login shell has; nothing of this test's process (its venv, PYTHONSAFEPATH, KUBECONFIG).
USER_ENV = ("HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "TERM", "TMPDIR", "KVPILOT_CACHE")


@dataclass
class Block:
    section: str
    script: str

    @property
    def commands(self) -> list[str]:
        return [c for line in self.script.splitlines() if (c := re.sub(r"\s+#.*$", "", line).strip())]

    @property
    def name(self) -> str:
        first = self.commands[0].removesuffix("\\").strip()  # a line continued on the next
        return f"{self.section}: {first}"


def readme_blocks() -> list[Block]:
    blocks, section = [], "top"
    for part in re.split(r"^(## .*)$", (ROOT / "README.md").read_text(), flags=re.M):
        if part.startswith("## "):
            section = part[3:].strip()
            continue
        blocks += [Block(section, m) for m in re.findall(r"^```(?:bash|sh)\n(.*?)^```", part, re.M | re.S)]
    return blocks


def user_env() -> dict[str, str]:
    venv_bins = {str(ROOT / ".venv" / "bin"), str(Path(sys.prefix) / "bin")}
    path = [p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep) if p not in venv_bins]
    env = {k: os.environ[k] for k in USER_ENV if k in os.environ}
    env.update({k: v for k, v in os.environ.items() if k.startswith("GO")})  # a user's Go setup
    return {**env, "PATH": os.pathsep.join(path)}


def copy_checkout(dest: Path) -> None:
    """Tracked and untracked-not-ignored files with their mtimes (`cp -p`), and the checkout's venv linked:
    a copied pyproject.toml newer than .venv/.installed would make `make serve` reinstall into that venv."""
    ls = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    files = subprocess.run(ls, cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file() or src.is_symlink():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f, follow_symlinks=False)
    (dest / ".venv").symlink_to(ROOT / ".venv")
    installed = ROOT / ".venv" / ".installed"
    assert installed.exists(), "no .venv/.installed: run `make setup` in the checkout first"
    assert (dest / "pyproject.toml").stat().st_mtime <= installed.stat().st_mtime, (
        "make would reinstall .venv"
    )
    assert subprocess.run(["make", "-q", "setup"], cwd=dest, env=user_env()).returncode == 0, (
        "setup not current"
    )


def check_ports_free() -> None:
    for port, what in PORTS.items():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError as exc:
                pytest.fail(
                    f"port {port} ({what} in README.md) is taken on this machine ({exc}): free it first"
                )


def start(block: Block, cwd: Path, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:  # a file, not a pipe: a block's background job may outlive the block
        argv = ["bash", "-euo", "pipefail", "-c", block.script]
        return subprocess.Popen(
            argv,
            cwd=cwd,
            env=user_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_ready(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if line := next((ln for ln in log.read_text(errors="replace").splitlines() if READY in ln), None):
            return line
        assert proc.poll() is None, f"exited with {proc.returncode} before its ready line:\n{tail(log)}"
        time.sleep(0.5)
    pytest.fail(f"no {READY!r} line within {timeout:.0f} s:\n{tail(log)}")


def tail(log: Path, n: int = 4000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no output)"


def group_alive(proc: subprocess.Popen) -> bool:
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(proc: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while group_alive(proc) and time.monotonic() < deadline:
            proc.poll()  # reap the leader
            time.sleep(0.2)


def kubectl_json(copy: Path, *args: str) -> dict:
    env = {**user_env(), "KUBECONFIG": str(copy / ".cluster" / "kubeconfig")}
    r = subprocess.run(["kubectl", *args, "-o", "json"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def after_kubernetes(copy: Path, operator_group: subprocess.Popen) -> None:
    """What the Kubernetes block promises: the operator (running on) made its peering object, and both resets,
    `kvpilot reset`'s and the annotation's, succeed on the fleet's pods."""
    assert group_alive(operator_group), tail(copy / "operator.log")
    kubectl_json(copy, "get", "clusterkopfpeering", "kvpilot")
    deadline = time.monotonic() + 120
    while True:
        resets = kubectl_json(copy, "get", "pcr")["items"]
        phases = sorted(r.get("status", {}).get("phase") or "" for r in resets)
        if phases == ["Succeeded", "Succeeded"]:
            return
        assert time.monotonic() < deadline, f"resets: {phases}\n{tail(copy / 'operator.log')}"
        time.sleep(1)


def test_readme_blocks_in_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocks = readme_blocks()
    first = blocks.pop(0)
    assert first.commands == ["make serve", "make test"], first.commands
    blocks = [b for b in blocks if b.commands != ["make demo"]]
    assert [b.section for b in blocks if b.commands[0] == "make serve"] == ["Try it"], "no shell-1 block"
    check_ports_free()
    copy = tmp_path / "kvpilot"
    copy.mkdir()
    copy_checkout(copy)
    installed = (ROOT / ".venv" / ".installed").stat().st_mtime

    groups: list[subprocess.Popen] = []
    durations: dict[str, float] = {}
    operator_group = None
    try:
        for i, block in enumerate(blocks):
            log = tmp_path / f"block-{i}.log"
            t0 = time.monotonic()
            proc = start(block, copy, log)
            groups.append(proc)
            if block.commands == ["make serve"]:  # shell 1: left running; the next block goes to shell 2
                line = wait_ready(proc, log, timeout=900)
                assert "http://localhost:8000" in line, line
            else:
                try:
                    rc = proc.wait(timeout=1500)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"{block.name}: still running after 1500 s:\n{tail(log)}")
                assert rc == 0, (
                    f"{block.name} failed ({rc}):\n{tail(log)}\noperator.log:\n{tail(copy / 'operator.log')}"
                )
            durations[block.name] = round(time.monotonic() - t0, 1)
            if block.section == "Try it" and block.commands[0].startswith(
                "curl"
            ):  # each reply on its own line
                replies = [ln for ln in log.read_text().splitlines() if ln.startswith("{")]
                assert len(replies) == 3 and all(json.loads(r) for r in replies), tail(log)
            if block.section == "On Kubernetes":
                operator_group = proc
                after_kubernetes(copy, proc)
            if block.section == "Install with Helm":  # helm test passed with the hand-run operator up, paused
                oplog = tail(copy / "operator.log", 20000)
                assert operator_group is not None and group_alive(operator_group), oplog
                assert "priority=100" in oplog and "including self" not in oplog, oplog
            if block.section == "Monitoring":
                assert "prometheusrule.monitoring.coreos.com/" in log.read_text(), tail(log)
        assert (ROOT / ".venv" / ".installed").stat().st_mtime == installed, (
            "make reinstalled the shared venv"
        )
        sections = [name.split(":")[0] for name in durations]
        assert sections == ["Try it", "Try it", "On Kubernetes", "Install with Helm", "Monitoring"], durations
    finally:
        for proc in groups:
            stop_group(proc)
        subprocess.run(["make", "cluster-down"], cwd=copy, env=user_env(), capture_output=True, timeout=300)
        (tmp_path / "readme-blocks.json").write_text(json.dumps(durations, indent=2) + "\n")
        with capsys.disabled():
            print("\nREADME blocks:", *(f"  {s:8.1f} s  {name}" for name, s in durations.items()), sep="\n")
