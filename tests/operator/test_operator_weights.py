"""WeightUpdate against the dev cluster: an InferenceDeployment of 3 real `kvpilot serve` daemons (the
embedded model, few blocks), a checkpoint on a host path every pod reads, the operator under its RBAC.
Atomic ends Succeeded with every pod on the new version and digest; a pod that never answers its stage
leaves all 3 on the old version; the API server refuses bad specs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.benchkit import changed_checkpoint
from support.cluster import Cluster, manifest
from support.operator import OperatorProcess, apply_ns, fleet, fleet_pods, infd, ready_replicas
from support.procs import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]
TOKEN = "wu-admin-token"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpilot.daemon.engine.default_model import ensure_default_model

    return changed_checkpoint(ensure_default_model(), tmp_path_factory.mktemp("wu-ckpt"))


@pytest.fixture
def llm(cluster: Cluster, ns: str, operator: OperatorProcess) -> Iterator[dict[str, str]]:
    """3 ready daemons of InferenceDeployment llm; pod name -> IP."""
    cluster.kubectl("create", "secret", "generic", "admin", "-n", ns, f"--from-literal=token={TOKEN}")
    # its owner's consent: only a labelled (or the fleet's own) Secret is mounted into a fleet's pods
    cluster.kubectl("label", "secret", "admin", "-n", ns, "kvpilot.io/admin-token=true")
    spec = {
        "replicas": 3,
        "adminTokenSecretRef": {"name": "admin"},
        "engine": {"kvCacheBlocks": 64, "maxNumSeqs": 2, "maxModelLen": 256, "dtype": "bfloat16"},
        "env": [{"name": "KVPILOT_CACHE", "value": str(Path.home() / ".cache" / "kvpilot")}],
    }
    apply_ns(cluster, ns, fleet("llm", spec))
    wait_for(lambda: ready_replicas(cluster, ns, "llm", 3), 300, "3 ready kvpilot daemons", interval=1)
    yield {p["metadata"]["name"]: p["status"]["podIP"] for p in fleet_pods(cluster, ns, "llm")}


def _get(ip: str) -> dict:
    import json
    import urllib.request

    req = urllib.request.Request(
        f"http://{ip}:8000/weight_info", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def kvpilot(cluster: Cluster, *args: str) -> subprocess.CompletedProcess:
    """The installed `kvpilot` command, against the dev cluster."""
    argv = [str(Path(sys.executable).parent / "kvpilot"), *args, "--kubeconfig", str(cluster.kubeconfig)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=400)


def wu(name: str, spec: dict) -> dict:
    return manifest("kvpilot.io/v1alpha1", "WeightUpdate", name, spec)


def wait_done(cluster: Cluster, ns: str, name: str, timeout: float) -> dict:
    def done() -> dict | None:
        obj = cluster.kubectl_json("get", "wu", name, "-n", ns)
        return obj if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed", "Degraded") else None

    return wait_for(done, timeout, f"WeightUpdate {ns}/{name} to finish", interval=1)  # type: ignore[return-value]


def test_atomic_update_then_a_stage_that_fails_on_one_pod(
    cluster: Cluster, ns: str, llm: dict[str, str], checkpoint: Path
) -> None:
    before = {name: _get(ip) for name, ip in llm.items()}
    old_version = {b["weight_version"] for b in before.values()}
    assert len(old_version) == 1

    # Atomic, through the CLI: every pod on v2 with one digest, each pod's line as it comes.
    r = kvpilot(
        cluster, "weights", "update", "llm", "-n", ns, "--path", str(checkpoint), "--version", "v2", "--wait"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("weightupdate.kvpilot.io/llm-") and lines[-1].startswith(
        "Succeeded: AllPodsUpdated"
    )
    for name in llm:
        assert any(name in x and "Succeeded" in x and "serves v2" in x for x in lines), r.stdout
    obj = cluster.kubectl_json("get", "wu", lines[0].split("/")[1].split()[0], "-n", ns)
    st = obj["status"]
    assert st["phase"] == "Succeeded", st
    assert obj["spec"]["strategy"] == "Atomic" and obj["spec"]["pauseMode"] == "wait"  # defaults
    assert st["succeeded"] == st["targets"] == 3 and st["progress"] == "3/3"
    digests = {p["stagedDigest"] for p in st["pods"]}
    assert len(digests) == 1 and st["digest"] in digests
    assert {p["version"] for p in st["pods"]} == {"v2"}
    for ip in llm.values():
        info = _get(ip)
        assert (info["weight_version"], info["digest"]) == ("v2", st["digest"])
    fst = infd(cluster, ns, "llm")["status"]
    assert (fst["weightVersion"], fst["weightVersions"]) == ("v2", {"v2": 3})

    # One pod frozen (SIGSTOP): its stage never answers; the stage is dropped on the others, no pod changes.
    frozen = sorted(llm)[0]
    pod = cluster.kubectl_json("get", "pod", frozen, "-n", ns)
    pid = int(pod["status"]["containerStatuses"][0]["containerID"].rsplit("/", 1)[-1])
    os.killpg(os.getpgid(pid), signal.SIGSTOP)
    try:
        spec = {
            "targetRef": {"name": "llm"},
            "modelPath": str(checkpoint),
            "version": "v3",
            "timeoutSeconds": 40,
        }
        apply_ns(cluster, ns, wu("to-v3", spec))
        st = wait_done(cluster, ns, "to-v3", 120)["status"]
    finally:
        os.killpg(os.getpgid(pid), signal.SIGCONT)
    assert st["phase"] == "Failed", st
    cond = {c["type"]: c for c in st["conditions"]}["Failed"]
    assert (
        cond["reason"] == "StageFailed" and "no pod changed" in cond["message"] and frozen in cond["message"]
    )
    results = {p["name"]: p["result"] for p in st["pods"]}
    assert (
        results[frozen] == "Failed"
        and sorted(v for k, v in results.items() if k != frozen) == ["Dropped"] * 2
    )
    for name, ip in llm.items():
        assert _get(ip)["weight_version"] == "v2", name

    # Rolling, 2 pods at a time: two batches, every pod on v4 in the end.
    wait_for(lambda: ready_replicas(cluster, ns, "llm", 3), 120, "the thawed pod ready again", interval=1)
    spec = {
        "targetRef": {"name": "llm"},
        "modelPath": str(checkpoint),
        "version": "v4",
        "strategy": "Rolling",
        "maxUnavailable": 2,
    }
    apply_ns(cluster, ns, wu("rolling", spec))
    st = wait_done(cluster, ns, "rolling", 300)["status"]
    assert st["phase"] == "Succeeded" and st["progress"] == "3/3", st
    assert {_get(ip)["weight_version"] for ip in llm.values()} == {"v4"}
    assert infd(cluster, ns, "llm")["status"]["weightVersions"] == {"v4": 3}  # v2's count is gone


def test_bad_specs_are_refused(cluster: Cluster, ns: str, operator: OperatorProcess) -> None:
    good = {"targetRef": {"name": "llm"}, "modelPath": "/ckpt", "version": "v2"}
    bad = [
        ({**good, "modelPath": "relative/dir"}, "absolute path"),
        ({**good, "version": "mixed"}, "not 'mixed'"),
        ({**good, "version": "initial"}, "'initial'"),  # the daemons' name for unnamed weights
        ({**good, "strategy": "Sideways"}, "Unsupported value"),
        ({**good, "maxUnavailable": 2}, "maxUnavailable is for the Rolling strategy"),
        ({k: v for k, v in good.items() if k != "version"}, "version: Required value"),
    ]
    for i, (spec, why) in enumerate(bad):
        obj = wu(f"bad-{i}", spec)
        obj["metadata"]["namespace"] = ns
        import yaml

        r = cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj), check=False)
        assert r.returncode != 0 and why in r.stderr, (spec, r.stderr)


def test_a_missing_target_fails_at_once(cluster: Cluster, ns: str, operator: OperatorProcess) -> None:
    apply_ns(cluster, ns, wu("lost", {"targetRef": {"name": "nope"}, "modelPath": "/ckpt", "version": "v2"}))
    st = wait_done(cluster, ns, "lost", 60)["status"]
    cond = {c["type"]: c for c in st["conditions"]}["Failed"]
    assert (st["phase"], cond["reason"]) == ("Failed", "TargetNotFound")
    assert cond["message"] == f"InferenceDeployment {ns}/nope not found"
    assert st["target"] == "InferenceDeployment/nope" and st["version"] == "v2"
