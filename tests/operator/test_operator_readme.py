"""The README's Kubernetes commands, exactly as written, against the dev cluster: `kubectl apply -f crds/` and
`kvpilot operator` are all it takes (the operator makes its own peering object and says so)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, STANDIN_ENV, Cluster, OperatorProcess, free_port, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

# What a user puts in my-inferencedeployment.yaml (the README names the file; the model is not the point
# here, so the daemons are stand-ins).
FLEET = {"apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "llm"},
         "spec": {"replicas": 2, "env": STANDIN_ENV}}  # fmt: skip


def tail(log: Path) -> str:
    return log.read_text()[-3000:] if log.exists() else "(not started)"


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"On Kubernetes.*?```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no Kubernetes block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.split("#")[0].strip()]


def test_readme_kubernetes_commands(cluster: Cluster, namespace: str, operator: OperatorProcess,
                                    tmp_path: Path) -> None:  # fmt: skip
    cmds = readme_commands()
    assert cmds[:2] == ["kubectl apply -f crds/", ".venv/bin/kvpilot operator"], cmds
    # the user's shell: a kubeconfig whose context points at the namespace, the repo's files, their yaml
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(cluster.kubeconfig.read_text())
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    subprocess.run(["kubectl", "config", "set-context", "--current", f"--namespace={namespace}"], env=env, check=True,
                   capture_output=True)  # fmt: skip
    (tmp_path / "crds").symlink_to(ROOT / "crds")
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")  # the checkout's venv, as `make setup` left it
    (tmp_path / "my-inferencedeployment.yaml").write_text(yaml.safe_dump(FLEET))

    operator.stop()  # one operator per peering priority at a time; this test runs its own
    cluster.kubectl("delete", "clusterkopfpeering", "kvpilot", "--ignore-not-found")
    log = tmp_path / "operator.log"
    op = None
    try:
        for cmd in cmds:
            if (
                cmd == ".venv/bin/kvpilot operator"
            ):  # the user runs it in another terminal; free ports instead of 8080/9090
                lport = free_port()
                op = subprocess.Popen(f"{cmd} --liveness-port {lport} --metrics-port {free_port()} --bind 127.0.0.1",
                                      shell=True, cwd=tmp_path, env=env, stdout=open(log, "wb"),  # noqa: SIM115
                                      stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
                wait_for(
                    lambda: "created the peering object kvpilot" in log.read_text(), 60, "the peering object"
                )
                continue
            r = subprocess.run(
                cmd, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
            )
            assert r.returncode == 0, f"{cmd}: {r.stdout}{r.stderr}\noperator log:\n{tail(log)}"
            if cmd.startswith(".venv/bin/kvpilot reset"):
                assert "Succeeded: AllPodsReset: 2/2 pods reset" in r.stdout, r.stdout
            if cmd == "kubectl get pcr":
                # TARGET PHASE TARGETS SUCCEEDED FAILED SKIPPED (counts by default, not "2/2")
                row = r.stdout.splitlines()[1].split()
                assert row[1:7] == ["InferenceDeployment/llm", "Succeeded", "2", "2", "0", "0"], r.stdout
        assert "peering 'kvpilot' with priority 0" in log.read_text()
        assert cluster.kubectl("get", "clusterkopfpeering", "kvpilot", check=False).returncode == 0
        # the annotation made a second reset, which finishes too
        wait_for(lambda: sum(i["status"].get("phase") == "Succeeded" for i in cluster.kubectl_json(
            "get", "pcr", "-n", namespace)["items"] if i.get("status")) == 2, 60, "the annotation's reset")  # fmt: skip
    finally:
        if op is not None and op.poll() is None:
            os.killpg(op.pid, signal.SIGTERM)
            op.wait(30)
        time.sleep(0.5)
        operator.start()
