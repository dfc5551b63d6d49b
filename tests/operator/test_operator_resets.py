"""Pure parts of the reset controller and the CLI: selectors, pod readiness, final phase, progress lines."""

from __future__ import annotations

import argparse

from kvpilot.operator import rbac
from kvpilot.operator.cli import add_operator_parser, add_reset_parser, describe_pod, reset_body
from kvpilot.operator.fanout import Target, initial_records, outcome
from kvpilot.operator.resets import label_selector, pod_target


def test_label_selector_strings() -> None:
    sel = {"matchLabels": {"b": "2", "a": "1"}, "matchExpressions": [
        {"key": "tier", "operator": "In", "values": ["x", "y"]}, {"key": "gpu", "operator": "Exists"},
        {"key": "old", "operator": "DoesNotExist"}, {"key": "z", "operator": "NotIn", "values": ["q"]}]}  # fmt: skip
    assert label_selector(sel) == "a=1,b=2,tier in (x,y),gpu,!old,z notin (q)"


def pod(ready: bool = True, deleting: bool = False, ip: str = "10.0.0.1") -> dict:
    meta = {"name": "p"} | ({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})
    return {"metadata": meta, "spec": {"nodeName": "node-1"},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}  # fmt: skip


def test_pod_target_readiness() -> None:
    assert pod_target(pod()) == Target("p", "node-1", "10.0.0.1", True, "")
    assert pod_target(pod(ready=False)).reason == "pod not Ready (phase Running)"
    t = pod_target(pod(deleting=True))
    assert not t.ready and t.reason == "pod is terminating"
    recs = initial_records([pod_target(pod(ip=""))])
    assert recs[0]["result"] == "Skipped" and recs[0]["message"] == "pod has no IP"


def test_outcome_is_failed_when_any_pod_is_not_reset() -> None:
    ok = {"name": "a", "result": "Succeeded"}
    assert outcome([ok, {"name": "b", "result": "Skipped", "message": "x"}])[:2] == (
        "Succeeded",
        "AllPodsReset",
    )
    assert outcome([])[:2] == ("Succeeded", "NoTargets")
    assert outcome([ok, {"name": "c", "result": "NotSupported"}])[:2] == ("Failed", "ResetNotSupported")
    phase, reason, msg = outcome([ok, {"name": "d", "result": "Failed", "message": "HTTP 500: boom"}])
    assert (
        (phase, reason) == ("Failed", "PodsFailed") and "d: HTTP 500: boom" in msg and "1/2 pods reset" in msg
    )


def test_cli_parsers_and_output() -> None:
    p = argparse.ArgumentParser(prog="kvpilot")
    sub = p.add_subparsers(dest="command", required=True)
    add_operator_parser(sub)
    add_reset_parser(sub)
    a = p.parse_args(
        ["reset", "llm", "-n", "prod", "--wait", "--reset-running-requests", "--max-concurrency", "8"]
    )
    assert (a.name, a.namespace, a.wait) == ("llm", "prod", True) and callable(a.handler)
    body = reset_body("llm", a)
    assert body["metadata"] == {"generateName": "llm-"}
    assert body["spec"] == {"targetRef": {"name": "llm"}, "resetRunningRequests": True, "maxConcurrency": 8}
    o = p.parse_args(["operator", "--standalone", "--metrics-port", "9999", "-n", "a", "-n", "b"])
    assert o.standalone and o.metrics_port == 9999 and o.namespace == ["a", "b"]
    line = describe_pod({"name": "llm-0", "result": "Succeeded", "epoch": 4, "evictedBlocks": 12,
                         "durationSeconds": 0.0123, "attempts": 1})  # fmt: skip
    assert "llm-0" in line and "epoch 4, 12 blocks evicted" in line and "(0.012s, 1 attempts)" in line


def test_rbac_rules_grant_no_wildcards_and_no_secret_listing() -> None:
    for rule in rbac.RULES:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
    secrets = [r for r in rbac.RULES if "secrets" in r["resources"]]
    assert secrets == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]
    role = rbac.cluster_role()
    assert role["kind"] == "ClusterRole" and role["rules"] == rbac.RULES
