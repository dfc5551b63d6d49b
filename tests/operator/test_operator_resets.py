"""Pure parts of the reset controller and the CLI: selectors, pod readiness, final phase, progress lines."""

from __future__ import annotations

import argparse

import pytest

from kvpilot.fanout import PodResult
from kvpilot.fanout.results import STILL_WARM
from kvpilot.operator import rbac
from kvpilot.operator.cli import add_operator_parser, add_reset_parser, describe_pod, reset_body
from kvpilot.operator.fleets.targets import Plan, pod_target, starting
from kvpilot.operator.resets.drive import outcome
from kvpilot.operator.resets.status import pod_status, verified_condition


def pod(
    ready: bool = True,
    deleting: bool = False,
    ip: str = "10.0.0.1",
    running: bool = True,
    controller: str = "rs-1",
) -> dict:
    meta = {"name": "p", "uid": "u1", "ownerReferences": [{"uid": controller, "controller": True}]}
    meta |= {"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {}
    state = {"running": {}} if running else {"waiting": {"reason": "CrashLoopBackOff"}}
    return {
        "metadata": meta,
        "spec": {"nodeName": "node-1"},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "containerStatuses": [{"name": "kvpilot", "state": state}],
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


PLAN = Plan("InferenceDeployment/f", "x=y", 8000, "t", "kvpilot", frozenset({"rs-1"}))


def test_who_is_called_ready_or_not() -> None:
    t = pod_target(pod(), PLAN)
    assert (t.name, t.ip, t.node, t.uid, t.skip_reason) == ("p", "10.0.0.1", "node-1", "u1", "")
    assert pod_target(pod(ready=False), PLAN).skip_reason == ""  # not Ready but running: called
    assert pod_target(pod(deleting=True), PLAN).skip_reason == "pod is terminating"
    assert pod_target(pod(ip=""), PLAN).skip_reason.startswith("pod has no IP")
    assert "no running engine container 'kvpilot'" in pod_target(pod(running=False), PLAN).skip_reason
    # a pod that only wears the fleet's labels never gets the fleet's token
    assert "not run by the InferenceDeployment" in pod_target(pod(controller="stranger"), PLAN).skip_reason


def test_a_pod_is_starting_until_it_has_been_ready_since_its_engine_started() -> None:
    def at(started: str, ready: str | None, since: str | None, container_ready: bool = False) -> dict:
        p = pod()
        st = p["status"]
        st["containerStatuses"][0].update(state={"running": {"startedAt": started}}, ready=container_ready)
        st["conditions"] = (
            [] if ready is None else [{"type": "Ready", "status": ready, "lastTransitionTime": since}]
        )
        return p

    assert starting(at("2026-01-01T00:01:00Z", "False", "2026-01-01T00:00:00Z"), "kvpilot")  # loading
    assert starting(at("2026-01-01T00:01:00Z", None, None), "kvpilot")  # no condition reported yet
    # restarted: the kubelet marked it not Ready a sync after the new container started
    assert starting(at("2026-01-01T00:01:00Z", "False", "2026-01-01T00:01:03Z"), "kvpilot")
    # Ready since it started, then failing its probe a minute on: it may hold what it cached
    assert not starting(at("2026-01-01T00:01:00Z", "False", "2026-01-01T00:02:00Z"), "kvpilot")
    assert not starting(at("2026-01-01T00:01:00Z", "True", "2026-01-01T00:01:20Z", True), "kvpilot")
    # its container exited and the kubelet restarts it (a back-off, or terminated a moment ago): starting again
    assert starting(pod(running=False), "kvpilot")
    stopped = pod()
    stopped["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 143}}
    assert starting(stopped, "kvpilot")
    # not when nothing restarts it: restartPolicy Never, or a pod that has ended
    stopped["spec"]["restartPolicy"] = "Never"
    assert not starting(stopped, "kvpilot")
    ended = pod(running=False)
    ended["status"]["phase"] = "Failed"
    assert not starting(ended, "kvpilot")
    assert not starting(at("2026-01-01T00:01:00Z", "False", "2026-01-01T00:00:00Z"), "sidecar")
    # a selector names no container: a ready sidecar beside the loading engine says nothing of it
    sidecar = at("2026-01-01T00:01:00Z", "False", "2026-01-01T00:00:00Z")
    sidecar["status"]["containerStatuses"].append(
        {"name": "istio-proxy", "ready": True, "state": {"running": {"startedAt": "2026-01-01T00:00:50Z"}}}
    )
    assert starting(sidecar, None) and starting(sidecar, "kvpilot")


def rec(name: str, result: str, message: str = "") -> PodResult:
    return PodResult(name, result=result, message=message)


def test_outcome_policies() -> None:
    ok = rec("a", "Succeeded")
    assert outcome([ok, rec("b", "Skipped", "x")])[:2] == ("Succeeded", "AllPodsReset")
    assert outcome([])[:2] == ("Failed", "NoTargets")
    assert outcome([rec("s", "Skipped")])[:2] == ("Failed", "NoTargets")
    assert outcome([], allow_no_targets=True)[:2] == ("Succeeded", "NoTargets")
    assert outcome([ok, rec("c", "NotSupported")])[:2] == ("Failed", "ResetNotSupported")
    phase, reason, msg = outcome([ok, rec("d", "Failed", "HTTP 500: boom")])
    assert (
        (phase, reason) == ("Failed", "PodsFailed") and "d: HTTP 500: boom" in msg and "1/2 pods reset" in msg
    )
    assert outcome([ok, ok, ok, rec("d", "Failed")], min_success_ratio=0.75)[:2] == (
        "Succeeded",
        "MinSuccessRatioMet",
    )


def test_status_is_bounded_with_failures_first() -> None:
    records = [rec(f"ok-{i:04d}", "Succeeded") for i in range(5000)] + [rec("zz-bad", "Failed", "HTTP 500")]
    st = pod_status(records)
    assert (st["targets"], st["succeeded"], st["failed"], st["progress"]) == (5001, 5000, 1, "5000/5001")
    assert len(st["pods"]) == 100 and st["podsOmitted"] == 4901 and st["pods"][0]["name"] == "zz-bad"


def test_cli_parsers_and_output() -> None:
    p = argparse.ArgumentParser(prog="kvpilot")
    sub = p.add_subparsers(dest="command", required=True)
    add_operator_parser(sub)
    add_reset_parser(sub)
    a = p.parse_args(
        ["reset", "llm", "-n", "prod", "--wait", "--reset-running-requests", "--max-concurrency", "8"]
    )
    assert (a.name, a.namespace, a.wait, a.timeout) == ("llm", "prod", True, None) and callable(a.handler)
    body = reset_body("llm", a)
    assert body["metadata"] == {"generateName": "llm-"}
    assert body["spec"] == {"targetRef": {"name": "llm"}, "resetRunningRequests": True, "maxConcurrency": 8}
    quick = reset_body("llm", p.parse_args(["reset", "llm", "--no-verify", "--no-reset-external"]))
    assert quick["spec"] == {"targetRef": {"name": "llm"}, "verify": False, "resetExternal": False}
    scoped = reset_body("llm", p.parse_args(["reset", "llm", "--lora-name", "policy", "--cache-salt", "t"]))
    assert scoped["spec"] == {"targetRef": {"name": "llm"}, "scope": {"loraName": "policy", "cacheSalt": "t"}}
    o = p.parse_args(["operator", "--standalone", "--metrics-port", "9999", "-n", "a", "-n", "b"])
    assert o.standalone and o.metrics_port == 9999 and o.namespace == ["a", "b"]
    line = describe_pod(
        {
            "name": "llm-0",
            "result": "Succeeded",
            "epoch": 4,
            "evictedBlocks": 12,
            "durationSeconds": 0.0123,
            "attempts": 1,
        }
    )
    assert "llm-0" in line and "epoch 4, 12 blocks evicted" in line and "(0.012s, 1 attempts)" in line
    assert "verified" not in line  # verify off: no verdict to show
    line = describe_pod({"name": "llm-0", "result": "Succeeded", "epoch": 4, "verified": "cold"})
    assert line.endswith("verified cold")
    line = describe_pod(
        {"name": "v", "result": "Succeeded", "verified": "unknown", "verification": "no usage"}
    )
    assert line.endswith("verified unknown: no usage")


def verdict(name: str, verified: str | None, result: str = "Succeeded", message: str = "") -> PodResult:
    r = PodResult(name, result=result, verified=verified, verify_message=message, cleared=["pool"])
    r.reason = STILL_WARM if verified == "warm" and result == "Failed" else ""
    return r


def test_verification_in_status_and_the_verified_condition() -> None:
    cold = [
        verdict(f"c{i}", "cold", message="the canary (300 tokens) found nothing cached") for i in range(3)
    ]
    st = pod_status(cold, verify=True)
    assert (st["verified"], st["verifiedCold"], st["verifiedWarm"], st["verifiedUnknown"]) == ("3/3", 3, 0, 0)
    assert st["pods"][0]["verified"] == "cold" and st["pods"][0]["cleared"] == ["pool"]
    assert "canary" in st["pods"][0]["verification"] and "reason" not in st["pods"][0]
    assert verified_condition(cold, True)[:2] == ("True", "AllCold")
    # verify off: no counts, the column says so, the condition says why it makes no claim
    assert pod_status(cold)["verified"] == "off" and "verifiedCold" not in pod_status(cold)
    assert verified_condition(cold, False)[:2] == ("Unknown", "VerificationOff")

    warm = verdict("w", "warm", "Failed", "the pod served 300 of 300 canary tokens from cache")
    unsure = verdict("u", "unknown", message="the pod reports no usage.prompt_tokens_details.cached_tokens")
    failed = verdict("f", None, "Failed", "HTTP 500")  # never said success: not the Verified condition's
    records = [*cold, warm, unsure, failed, verdict("s", None, "Skipped")]
    st = pod_status(records, verify=True)
    assert st["verified"] == "3/5" and (st["verifiedWarm"], st["verifiedUnknown"]) == (1, 1)
    assert next(p for p in st["pods"] if p["name"] == "w")["reason"] == STILL_WARM
    status, reason, message = verified_condition(records, True)
    assert (
        (status, reason) == ("False", "StillWarm")
        and "1/5 pods" in message
        and "w: the pod served" in message
    )
    status, reason, message = verified_condition([*cold, unsure, failed], True)
    assert (status, reason) == ("Unknown", "NotVerified") and "3/4 pods verified cold" in message
    assert "u: the pod reports no usage" in message
    assert verified_condition([failed], True)[:2] == ("Unknown", "NothingVerified")


@pytest.mark.parametrize("clusterwide", [True, False])
def test_rbac_rules_grant_no_wildcards_and_no_secret_listing(clusterwide: bool) -> None:
    cluster, role = rbac.operator_rules(clusterwide)
    rules = [*cluster, *role, *rbac.ROUTER_RULES]
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
    secrets = [r for r in rules if "secrets" in r["resources"]]
    assert secrets == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]}]
    # No rights on Roles or ClusterRoles but `bind` on the routers' one; nothing namespaced cluster-wide in
    # namespaced mode.
    rbac_rules = [r for r in rules if r["apiGroups"] == ["rbac.authorization.k8s.io"]]
    assert [r["resources"] for r in rbac_rules] == [["rolebindings"], ["clusterroles"]]
    assert rbac_rules[1] == rbac.bind_router_role(rbac.ROUTER_CLUSTER_ROLE)
    if not clusterwide:
        assert {r for rule in cluster for r in rule["resources"]} == {
            "customresourcedefinitions",
            "namespaces",
        }
    assert rbac.cluster_role()["rules"] == rbac.operator_rules(True)[0]
