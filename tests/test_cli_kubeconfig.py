"""Every CLI command that talks to Kubernetes turns a missing or broken kubeconfig into one line that names the
problem and the fix, and exits 2: no traceback (kvpilot/kube/kubeconfig.py); so does the operator whose API
server is unreachable or whose metrics port is taken. Run as a user types them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from support.procs import free_port

COMMANDS = {
    "operator": ["-m", "kvpilot", "operator"],
    "operator-main": ["-m", "kvpilot.operator.main"],
    "reset": ["-m", "kvpilot", "reset", "llm"],
    "router": ["-m", "kvpilot", "router", "--fleet", "llm"],
    "endpoint": ["-m", "kvpilot", "endpoint", "llm"],
}
NO_CONTEXT = """apiVersion: v1
kind: Config
clusters: [{name: dev, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: dev, user: {token: x}}]
contexts: [{name: dev, context: {cluster: dev, user: dev}}, {name: other, context: {cluster: dev, user: dev}}]
"""
# case -> (KUBECONFIG to set, or None; what the line says)
CASES = {
    "no-file": (None, ["no kubeconfig", "KUBECONFIG is not set", "make cluster-up", "export KUBECONFIG="]),
    "kubeconfig-nowhere": ("nowhere", ["no kubeconfig", "names no file", "make cluster-up"]),
    "garbage-yaml": ("garbage", ["is not valid YAML", "(line ", "make cluster-up"]),
    "not-a-mapping": ("list", ["is not a kubeconfig", "make cluster-up"]),
    "no-current-context": (
        "nocontext",
        ["has no current context", "kubectl config use-context", "dev, other"],
    ),
}
FILES = {"garbage": "apiVersion: v1\nclusters: [oops\n", "list": "- 1\n- 2\n", "nocontext": NO_CONTEXT}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_broken_kubeconfig_is_one_line_with_the_fix(command: str, case: str, tmp_path: Path) -> None:
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    kubeconfig, says = CASES[case]
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    env["HOME"] = str(tmp_path)  # no ~/.kube/config
    if kubeconfig:
        env["KUBECONFIG"] = str(tmp_path / kubeconfig)
    proc = subprocess.run(
        [sys.executable, *COMMANDS[command]], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert all(s in lines[0] for s in says), lines[0]


def test_the_operator_on_a_port_in_use_says_so_in_one_line_before_calling_the_cluster(tmp_path: Path) -> None:
    # The kubeconfig's server refuses every connection: an operator that called it before binding its metrics
    # port would fail on that instead (or retry), not on the port.
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(NO_CONTEXT + "current-context: dev\n")
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    env["KUBECONFIG"] = str(kubeconfig)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, *COMMANDS["operator"], "--bind", "127.0.0.1", "--metrics-port", str(port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot serve metrics on 127.0.0.1:{port}: "), proc.stderr
    assert "--metrics-port" in last and "Traceback" not in proc.stderr, proc.stderr


def test_the_operator_that_cannot_reach_the_api_server_says_so_in_one_line(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(NO_CONTEXT + "current-context: dev\n")  # its server refuses every connection
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    env["KUBECONFIG"] = str(kubeconfig)
    proc = subprocess.run(
        [sys.executable, *COMMANDS["operator"], "--bind", "127.0.0.1", "--metrics-port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot reach the Kubernetes API: ") and "127.0.0.1" in last, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
