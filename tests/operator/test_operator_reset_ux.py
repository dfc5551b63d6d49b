"""Resets as a user reads them: `kubectl get pcr` columns from the first moment, missing targets and empty
selectors failing at once, skipped and replacing pods named in the condition, waiting for either end in one
`kubectl wait`, and no finalizer left on a finished reset (or any InferenceDeployment) once the operator is
gone. The real operator on the dev cluster (conftest.py), stand-in daemons (shim/)."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from kvpilot.fanout import PodResult
from kvpilot.operator.resets.drive import outcome
from kvpilot.operator.resets.status import MAX_NAMED, skipped_note
from support.cluster import Cluster
from support.operator import (
    OperatorProcess,
    apply_ns,
    fleet,
    fleet_pods,
    pcr,
    standin_fleet,
    standin_spec,
    wait_phase,
)
from support.procs import wait_for

FINALIZER = "kvpilot.io/operator"
COLUMNS = ["NAME", "TARGET", "PHASE", "TARGETS", "SUCCEEDED", "FAILED", "SKIPPED", "VERIFIED", "AGE"]


def get_row(cluster: Cluster, ns: str, name: str) -> dict[str, str]:
    """One `kubectl get pcr NAME` row as the user sees it, by header (default columns, not -o wide)."""
    head, row = cluster.kubectl("get", "pcr", name, "-n", ns).stdout.splitlines()
    assert head.split() == COLUMNS, head
    starts = [head.index(c) for c in COLUMNS] + [None]
    return {c: row[starts[i] : starts[i + 1]].strip() for i, c in enumerate(COLUMNS)}


def wait_end(cluster: Cluster, ns: str, name: str, timeout: int):  # noqa: ANN201 - a CompletedProcess
    """The one command docs/operator.md gives to wait for Complete or Failed, whichever comes."""
    return cluster.kubectl(
        "wait", "--for=jsonpath={.status.completionTime}", f"pcr/{name}", "-n", ns, f"--timeout={timeout}s"
    )


def condition(obj: dict) -> dict:
    return next(c for c in obj["status"]["conditions"] if c["status"] == "True")


# -------------------------------------------------------------------------------- no cluster


def test_skipped_pods_and_replacements_are_named_and_bounded() -> None:
    gone = [
        PodResult(f"llm-{i:04d}", result="Skipped", message="pod deleted during the reset")
        for i in range(900)
    ]
    moved = PodResult(
        "llm-ip", result="Skipped", message="pod IP changed during the reset (10.0.0.1 -> 10.0.0.9)"
    )
    ok = [PodResult("llm-a", result="Succeeded"), PodResult("llm-b", result="Succeeded")]
    phase, reason, msg = outcome([*ok, moved, *gone[:1]], newcomers=["llm-new1", "llm-new2"])
    assert (phase, reason) == ("Succeeded", "AllPodsReset")
    assert msg.startswith("2/4 pods reset, 0 failed, 2 skipped")
    assert "llm-0000 (pod deleted during the reset)" in msg and "llm-ip (pod IP changed" in msg
    assert "replaced by llm-new1, llm-new2 (created during the reset" in msg
    # thousands of skipped and new pods: a few names, the rest counted
    note = skipped_note([*gone, moved], [f"new-{i}" for i in range(900)])
    assert len(note) < 600, note
    assert f"{901 - MAX_NAMED} more skipped (status.pods)" in note and "and 895 more" in note
    long = PodResult("x", result="Skipped", message="m" * 5000)
    assert len(skipped_note([long])) < 200
    assert skipped_note(ok) == "" and "new pods n1 (" in skipped_note(ok, ["n1"])


# -------------------------------------------------------------------------------- on the dev cluster


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_get_shows_target_and_counts_and_missing_targets_fail_at_once(cluster: Cluster, ns: str) -> None:
    t0 = time.monotonic()
    apply_ns(cluster, ns, pcr("ghost", {"targetRef": {"name": "nowhere"}}))  # timeoutSeconds 60
    apply_ns(cluster, ns, pcr("empty", {"selector": {"matchLabels": {"app": "none"}}}))
    # `kubectl wait` for either end in one command: completionTime is set at both
    for name in ("ghost", "empty"):
        assert wait_end(cluster, ns, name, 30).returncode == 0
    assert time.monotonic() - t0 < 15, (
        "a missing target or an empty selector must not wait for timeoutSeconds"
    )
    ghost = cluster.kubectl_json("get", "pcr", "ghost", "-n", ns)
    assert condition(ghost)["type"] == "Failed" and condition(ghost)["reason"] == "TargetNotFound"
    assert "waitForTarget" in condition(ghost)["message"]
    row = get_row(cluster, ns, "ghost")
    assert (row["TARGET"], row["PHASE"], row["TARGETS"]) == (
        "InferenceDeployment/nowhere",
        "Failed",
        "",  # no pod was listed: no count
    )
    empty = cluster.kubectl_json("get", "pcr", "empty", "-n", ns)
    assert condition(empty)["reason"] == "NoTargets" and "no pod matched" in condition(empty)["message"]
    row = get_row(cluster, ns, "empty")
    assert (row["TARGET"], row["PHASE"], row["TARGETS"], row["SKIPPED"]) == ("app=none", "Failed", "0", "0")

    # waitForTarget: Pending with its target at first sight, reset once the fleet exists
    apply_ns(cluster, ns, pcr("early", {"targetRef": {"name": "late"}, "waitForTarget": True}))
    wait_for(lambda: get_row(cluster, ns, "early")["PHASE"] == "Pending", 10, "phase Pending at first sight")
    assert get_row(cluster, ns, "early")["TARGET"] == "InferenceDeployment/late"
    apply_ns(cluster, ns, fleet("late", {"replicas": 1, **standin_spec()}))
    assert wait_end(cluster, ns, "early", 90).returncode == 0
    row = get_row(cluster, ns, "early")
    counts = (row["PHASE"], row["TARGETS"], row["SUCCEEDED"], row["FAILED"], row["SKIPPED"])
    assert counts == ("Succeeded", "1", "1", "0", "0"), row
    # a stand-in serves no completions: reset, and not verified cold, which the condition says
    assert row["VERIFIED"] == "0/1", row
    early = cluster.kubectl_json("get", "pcr", "early", "-n", ns)["status"]
    verified = next(c for c in early["conditions"] if c["type"] == "Verified")
    assert (verified["status"], verified["reason"]) == ("Unknown", "NotVerified"), verified
    assert early["pods"][0]["verified"] == "unknown" and "/v1/models" in early["pods"][0]["verification"]

    # the field is documented and refused where it means nothing
    explain = cluster.kubectl("explain", "pcr.spec.waitForTarget").stdout
    assert "TargetNotFound" in explain
    bad = pcr("bad", {"selector": {"matchLabels": {"app": "x"}}, "waitForTarget": True})
    refused = cluster.kubectl("apply", "-n", ns, "-f", "-", check=False, input=yaml.safe_dump(bad))
    assert refused.returncode != 0 and "waitForTarget is for targetRef resets" in refused.stderr


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_replaced_pods_are_named_in_the_condition(cluster: Cluster, ns: str) -> None:
    standin_fleet(cluster, ns, "churn", 2, [{"name": "STANDIN_DELAY", "value": "4"}])  # each reset call: 4 s
    first, second = sorted(p["metadata"]["name"] for p in fleet_pods(cluster, ns, "churn"))
    # one call at a time, in name order: the second pod is deleted while the first is being reset
    apply_ns(
        cluster, ns, pcr("r", {"targetRef": {"name": "churn"}, "maxConcurrency": 1, "timeoutSeconds": 60})
    )
    wait_for(lambda: get_row(cluster, ns, "r")["PHASE"] == "Running", 20, "the reset running")
    cluster.kubectl("delete", "pod", second, "-n", ns, "--wait=false")
    wait_for(lambda: len(fleet_pods(cluster, ns, "churn")) == 2, 20, "the replacement pod")
    new = next(
        p["metadata"]["name"] for p in fleet_pods(cluster, ns, "churn") if p["metadata"]["name"] != first
    )
    obj = wait_phase(cluster, ns, "r", 60)
    cond = condition(obj)
    assert (obj["status"]["phase"], cond["type"], cond["reason"]) == ("Succeeded", "Complete", "AllPodsReset")
    assert cond["message"].startswith("1/2 pods reset, 0 failed, 1 skipped"), cond["message"]
    assert f"skipped {second} (pod" in cond["message"] and "during the reset" in cond["message"], cond[
        "message"
    ]
    assert f"replaced by {new} (created during the reset" in cond["message"], cond["message"]
    row = get_row(cluster, ns, "r")
    assert (row["TARGETS"], row["SUCCEEDED"], row["FAILED"], row["SKIPPED"]) == ("2", "1", "0", "1"), row


def finalizers(cluster: Cluster, ns: str, kind: str, name: str) -> list[str]:
    return cluster.kubectl_json("get", kind, name, "-n", ns)["metadata"].get("finalizers") or []


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_finalizer_only_while_a_reset_runs(cluster: Cluster, ns: str, operator: OperatorProcess) -> None:
    standin_fleet(cluster, ns, "fin", 1, [{"name": "STANDIN_DELAY", "value": "3"}])
    apply_ns(cluster, ns, pcr("run", {"targetRef": {"name": "fin"}}))
    apply_ns(cluster, ns, pcr("kept", {"targetRef": {"name": "fin"}, "ttlSecondsAfterFinished": 40}))
    # running: kopf's finalizer keeps the daemon's object until the daemon has stopped
    wait_for(
        lambda: FINALIZER in finalizers(cluster, ns, "pcr", "run"), 10, "the finalizer on a running reset"
    )
    for name in ("run", "kept"):
        assert wait_phase(cluster, ns, name, 60)["status"]["phase"] == "Succeeded"
        wait_for(lambda n=name: not finalizers(cluster, ns, "pcr", n), 10, f"no finalizer on finished {name}")
    assert not finalizers(cluster, ns, "infd", "fin")  # owned objects go by ownerReferences: none needed

    operator.stop()  # as after `helm uninstall`: nothing removes a finalizer now
    try:
        t0 = time.monotonic()
        cluster.kubectl("delete", "pcr", "run", "-n", ns, "--timeout=20s")
        cluster.kubectl("delete", "infd", "fin", "-n", ns, "--timeout=20s")
        assert time.monotonic() - t0 < 10
        # what an older operator left on a finished reset: the next one removes it
        old = json.dumps({"metadata": {"finalizers": [FINALIZER]}})
        cluster.kubectl("patch", "pcr", "kept", "-n", ns, "--type=merge", "-p", old)
    finally:
        logged = operator.log.stat().st_size
        operator.start()
    wait_for(lambda: not finalizers(cluster, ns, "pcr", "kept"), 20, "the old finalizer removed")
    # the TTL of a finished reset is still kept, by a restarted operator too, with no finalizer meanwhile

    def gone() -> bool:
        return cluster.kubectl("get", "pcr", "kept", "-n", ns, check=False).returncode != 0

    wait_for(gone, 60, "the finished reset deleted after its TTL by the restarted operator")
    assert f"deleting PrefixCacheReset {ns}/kept" in operator.log.read_text(errors="replace")[logged:]
