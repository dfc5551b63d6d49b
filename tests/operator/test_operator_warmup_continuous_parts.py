"""PrefixCacheWarmup mode Continuous without a cluster: which pods a look finds due and why (joined, restarted,
after a reset or a weight update, retried), what a pass's results pay, the alert's gauge, the markers read
from a fleet's status and from selector resets, and the spec's mode."""

from __future__ import annotations

import pytest

from kvpilot.fanout import PodResult, Verified
from kvpilot.fanout.results import NOT_WARM, Outcome
from kvpilot.operator.fleets import builders
from kvpilot.operator.fleets.reconcile import gates
from kvpilot.operator.fleets.targets import Plan
from kvpilot.operator.specs import FleetSpec, WarmupSpec
from kvpilot.operator.warmups.continuous import (
    JOINED,
    RESET,
    RESTARTED,
    RETRY,
    WEIGHTS,
    Seen,
    Tracker,
    fleet_marker,
    gate_change,
    gate_status,
    gated,
    pod_key,
    reapply_reason,
    seen,
    selector_reset_marker,
)
from kvpilot.operator.warmups.status import warm_condition


def warm(name: str) -> PodResult:
    return PodResult(name, result=Outcome.SUCCEEDED, verified=Verified.WARM)


def cold(name: str) -> PodResult:
    return PodResult(name, result=Outcome.FAILED, verified=Verified.COLD, reason=NOT_WARM)


def look(**pods: tuple[str, int, bool]) -> dict[str, Seen]:
    return {n: Seen((uid, restarts), ready) for n, (uid, restarts, ready) in pods.items()}


def test_a_first_look_owes_every_pod_and_calls_the_ready_ones() -> None:
    t = Tracker()
    assert t.due(look(a=("u1", 0, True), b=("u2", 0, False)), 0.0) == {"a": JOINED}
    t.record([warm("a")], 1.0)
    assert t.due(look(a=("u1", 0, True), b=("u2", 0, False)), 2.0) == {}
    # b is up now: warmed as a pod that joined; a, warm, is left alone
    assert t.due(look(a=("u1", 0, True), b=("u2", 0, True)), 3.0) == {"b": JOINED}


def test_a_new_uid_and_an_engine_restart_make_a_pod_due_again() -> None:
    t = Tracker()
    t.due(look(a=("u1", 0, True), b=("u2", 0, True)), 0.0)
    t.record([warm("a"), warm("b")], 1.0)
    due = t.due(look(a=("u9", 0, True), b=("u2", 1, True), c=("u3", 0, True)), 2.0)
    assert due == {"a": JOINED, "b": RESTARTED, "c": JOINED}
    # a restarted pod's old result is not shown as its state: it is pending until warmed again
    assert [r.result for r in t.results(look(b=("u2", 1, True)))][1] == Outcome.PENDING


def test_a_reset_or_a_weight_update_owes_every_pod_even_one_not_ready() -> None:
    t = Tracker()
    pods = look(a=("u1", 0, True), b=("u2", 0, True))
    t.due(pods, 0.0)
    t.record([warm("a"), warm("b")], 1.0)
    down = look(a=("u1", 0, True), b=("u2", 0, False))
    assert t.due(down, 2.0, RESET) == {"a": RESET}
    t.record([warm("a")], 3.0)
    assert t.due(pods, 4.0) == {"b": RESET}  # b was owed the reset's pass while it was down
    t.record([warm("b")], 5.0)
    assert t.due(pods, 6.0, WEIGHTS) == {"a": WEIGHTS, "b": WEIGHTS}


def test_a_pod_not_warmed_is_retried_after_the_retry_interval_and_counted_cold() -> None:
    t = Tracker(retry_s=30.0)
    pods = look(a=("u1", 0, True))
    t.due(pods, 100.0)
    t.record([cold("a")], 101.0)
    assert t.due(pods, 120.0) == {}
    assert t.oldest_cold_s(pods, 120.0) == pytest.approx(20.0)
    assert t.due(pods, 131.0) == {"a": RETRY}
    t.record([cold("a")], 132.0)
    assert t.oldest_cold_s(pods, 700.0) == pytest.approx(600.0)  # owed since it was first due
    t.due(pods, 800.0)
    t.record([warm("a")], 801.0)
    assert t.oldest_cold_s(pods, 802.0) == 0.0
    # a pending pass (interrupted) pays nothing
    t.due(pods, 900.0, RESET)
    t.record([PodResult("a")], 901.0)
    assert t.due(pods, 902.0) == {"a": RESET}


def test_the_gauge_leaves_out_pods_still_starting_and_forgets_pods_gone() -> None:
    t = Tracker()
    t.due(look(a=("u1", 0, False)), 0.0)
    assert t.oldest_cold_s(look(a=("u1", 0, False)), 1000.0) == 0.0
    t.due(look(a=("u1", 0, True)), 1000.0)
    assert t.oldest_cold_s(look(a=("u1", 0, True)), 1010.0) == pytest.approx(10.0)
    t.due({}, 1020.0)
    assert t.pods == {} and t.oldest_cold_s({}, 1030.0) == 0.0


def test_the_warm_condition_is_over_the_current_pods() -> None:
    t = Tracker()
    pods = look(a=("u1", 0, True), b=("u2", 0, True))
    t.due(pods, 0.0)
    t.record([warm("a"), cold("b")], 1.0)
    assert warm_condition(t.results(pods))[:2] == ("False", NOT_WARM)
    t.due(look(a=("u1", 0, True)), 2.0)  # b went away
    assert warm_condition(t.results(look(a=("u1", 0, True))))[:2] == ("True", "AllWarm")


def _pod(restarts: dict[str, int], ready: bool = True, started: str = "2026-01-01T00:00:00Z") -> dict:
    statuses = [
        {"name": n, "restartCount": r, "ready": ready, "state": {"running": {"startedAt": started}}}
        for n, r in restarts.items()
    ]
    return {
        "metadata": {"name": "p", "uid": "u"},
        "spec": {"nodeName": "n"},
        "status": {"podIP": "10.0.0.1", "containerStatuses": statuses},
    }


def test_pod_key_counts_the_engine_containers_restarts_and_seen_waits_for_the_engine() -> None:
    pod = _pod({"daemon": 2, "sidecar": 5})
    assert pod_key(pod, "daemon") == ("u", 2)
    assert pod_key(pod, None) == ("u", 7)
    plan = Plan("x", "a=b", 8000, None, "daemon", frozenset({"other"}))
    assert seen(pod, plan) == Seen(("u", 2), True)  # membership is the pass's business, not the look's
    assert seen(_pod({"daemon": 0}, ready=False), plan).ready is False  # still loading its model
    gone = _pod({"daemon": 0})
    gone["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert seen(gone, plan).ready is False


def test_markers_move_on_a_new_reset_or_new_weights() -> None:
    a = fleet_marker({"status": {"lastReset": {"name": "r1", "time": "t1", "result": "Succeeded"}}})
    b = fleet_marker({"status": {"lastReset": {"name": "r2", "time": "t2", "result": "Failed"}}})
    c = fleet_marker({"status": {"lastReset": {"name": "r2", "time": "t2"}, "weightVersion": "v2"}})
    assert reapply_reason(None, a) is None  # the first look: the first pass warms everyone anyway
    assert reapply_reason(a, a) is None
    assert reapply_reason(a, b) == RESET
    assert reapply_reason(b, c) == WEIGHTS
    assert fleet_marker(None) == fleet_marker({})
    resets = [
        {"metadata": {"name": "x"}, "status": {"target": "app=a", "completionTime": "2026-01-01T00:00:02Z"}},
        {"metadata": {"name": "y"}, "status": {"target": "app=a", "completionTime": "2026-01-01T00:00:09Z"}},
        {"metadata": {"name": "z"}, "status": {"target": "app=b", "completionTime": "2026-01-01T00:00:10Z"}},
        {"metadata": {"name": "w"}, "status": {"target": "app=a", "phase": "Running"}},
    ]
    assert selector_reset_marker(resets, "app=a") == "y@2026-01-01T00:00:09Z"
    assert selector_reset_marker(resets, "app=c") == ""


def test_the_spec_takes_mode_continuous() -> None:
    spec = WarmupSpec.parse({"targetRef": {"name": "a"}, "prompts": [{"prompt": "x"}], "mode": "Continuous"})
    assert spec.mode == "Continuous"
    with pytest.raises(ValueError):
        WarmupSpec.parse({"targetRef": {"name": "a"}, "prompts": [{"prompt": "x"}], "mode": "Always"})


# ---- gateReadiness ---------------------------------------------------------------------------------------
def test_the_gate_opens_once_warmed_stays_open_through_a_reset_and_shuts_on_a_restart() -> None:
    t = Tracker()
    pods = look(a=("u1", 0, True))
    t.due(pods, 0.0)
    assert t.gate("a") is False
    t.record([cold("a")], 1.0)
    assert t.gate("a") is False  # cold: still out
    t.due(pods, 40.0)
    t.record([warm("a")], 41.0)
    assert t.gate("a") is True
    t.due(pods, 42.0, RESET)
    t.record([cold("a")], 43.0)
    assert t.gate("a") is True  # a pass after a reset never takes a serving pod out
    t.due(look(a=("u1", 1, True)), 44.0)
    assert t.gate("a") is False  # its engine restarted: out until warmed again
    assert t.gate("nobody") is False


def test_gated_pods_and_their_condition() -> None:
    pod = {"metadata": {"name": "p"}, "spec": {"readinessGates": [{"conditionType": "kvpilot.io/warm"}]}}
    assert gated(pod) and gate_status(pod) is None
    pod["status"] = {"conditions": [{"type": "kvpilot.io/warm", "status": "False"}]}
    assert gate_status(pod) == "False"
    assert not gated({"metadata": {"name": "q"}, "spec": {"readinessGates": [{"conditionType": "other"}]}})


def test_the_fleet_template_carries_the_gate_only_while_a_gating_warmup_targets_it() -> None:
    spec = FleetSpec.parse({"replicas": 2})
    assert "readinessGates" not in builders.workload("llm", spec)["spec"]["template"]["spec"]
    tpl = builders.workload("llm", spec, gated=True)["spec"]["template"]["spec"]
    assert tpl["readinessGates"] == [{"conditionType": "kvpilot.io/warm"}]
    w = {
        "metadata": {"name": "w"},
        "spec": {"mode": "Continuous", "gateReadiness": True, "targetRef": {"name": "llm"}},
        "status": {"phase": "Watching"},
    }
    assert gates(w, "llm") and not gates(w, "other")
    assert not gates({**w, "spec": {**w["spec"], "gateReadiness": False}}, "llm")
    assert not gates({**w, "spec": {**w["spec"], "mode": "Once"}}, "llm")
    assert not gates({**w, "status": {"phase": "Failed"}}, "llm")
    assert not gates({**w, "metadata": {"name": "w", "deletionTimestamp": "2026-01-01T00:00:00Z"}}, "llm")


def test_gate_change_opens_shuts_on_a_restart_and_leaves_another_warmups_open_gate() -> None:
    def pod(cond: dict | None, started: str = "2026-01-01T00:01:00Z") -> dict:
        running = {"name": "daemon", "state": {"running": {"startedAt": started}}}
        return {
            "metadata": {"name": "p"},
            "status": {"conditions": [cond] if cond else [], "containerStatuses": [running]},
        }

    def warm_cond(status: str, at: str) -> dict:
        return {"type": "kvpilot.io/warm", "status": status, "lastTransitionTime": at}

    assert gate_change(pod(None), False, "daemon") is False  # joined: shut, visibly
    assert gate_change(pod(None), True, "daemon") is True
    assert gate_change(pod(warm_cond("False", "2026-01-01T00:01:05Z")), True, "daemon") is True
    assert gate_change(pod(warm_cond("True", "2026-01-01T00:01:05Z")), True, "daemon") is None
    assert gate_change(pod(warm_cond("False", "2026-01-01T00:01:05Z")), False, "daemon") is None
    # opened since the engine started, by another warm-up: left open
    assert gate_change(pod(warm_cond("True", "2026-01-01T00:01:05Z")), False, "daemon") is None
    # opened before the engine's last start (it restarted): shut until warmed again
    assert gate_change(pod(warm_cond("True", "2026-01-01T00:00:30Z")), False, "daemon") is False
