"""PrefixCacheWarmup on the dev cluster: the operator (RBAC-limited, as a subprocess) warms a fleet of two real
`kvpilot serve` daemons from a ConfigMap's prompts, verifies each pod warm, and the pods' caches really hold
the prompts; a PrefixCacheReset empties them and a new warm-up proves them warm again. Then what must fail
does, with its reason: a fleet of stand-ins that cache nothing (NotWarm), a missing or broken ConfigMap
(PromptsNotFound, InvalidPrompts), no pods (NoTargets), and specs the API server refuses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from kvpilot.fanout import warm_prompts
from support import ROOT
from support.cluster import Cluster, manifest
from support.operator import (
    OperatorProcess,
    apply_ns,
    fleet,
    fleet_pods,
    http,
    pcr,
    ready_replicas,
    service_endpoints,
    standin_fleet,
)
from support.procs import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

SYSTEM = (
    "You are the support assistant of the kvpilot fleet. Answer in one short sentence, cite the manual "
    "section you used, and never invent a section number. "
) * 3
DOCUMENT = "Release notes, version 7. " + "The operator warms every pod before a benchmark starts. " * 6
PROMPTS = [
    {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How do I reset?"}]},
    {"prompt": DOCUMENT},
]


def pcw(name: str, spec: dict) -> dict:
    return manifest("kvpilot.io/v1alpha1", "PrefixCacheWarmup", name, spec)


def wait_done(cluster: Cluster, ns: str, name: str, timeout: float = 180) -> dict:
    def done() -> dict | None:
        obj = cluster.kubectl_json("get", "pcw", name, "-n", ns)
        return obj if (obj.get("status") or {}).get("completionTime") else None

    return wait_for(done, timeout, f"PrefixCacheWarmup {ns}/{name} to finish")  # type: ignore[return-value]


def condition(obj: dict, type_: str) -> tuple[str, str, str]:
    c = next(c for c in obj["status"]["conditions"] if c["type"] == type_)
    return c["status"], c["reason"], c["message"]


def cached(ip: str, prompt: dict) -> int:
    """The pod's cached tokens of one of PROMPTS, sent as the warm-up sends it (the served model)."""
    model = http("GET", f"http://{ip}:8000/v1/models")["data"][0]["id"]
    path = "chat/completions" if "messages" in prompt else "completions"
    body = {"model": model, **prompt, "max_tokens": 1, "temperature": 0}
    return http("POST", f"http://{ip}:8000/v1/{path}", body)["usage"]["prompt_tokens_details"][
        "cached_tokens"
    ]


def prompts_config_map(cluster: Cluster, ns: str, name: str, text: str) -> None:
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"prompts.yaml": text}}
    apply_ns(cluster, ns, cm)


# --------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(900)  # two daemons to load, two warm-ups, a reset, then the docs' script and its bench
def test_warm_two_real_daemons_reset_them_and_warm_them_again(
    cluster: Cluster, ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    engine = {"kvCacheBlocks": 256, "maxNumSeqs": 4, "maxModelLen": 512}
    apply_ns(cluster, ns, fleet("llm", {"replicas": 2, "engine": engine}))
    prompts_config_map(cluster, ns, "prompts", yaml.safe_dump(PROMPTS))
    wait_for(lambda: ready_replicas(cluster, ns, "llm", 2), 300, "2 ready kvpilot daemons", interval=1)
    pods = {p["metadata"]["name"]: p["status"]["podIP"] for p in fleet_pods(cluster, ns, "llm")}
    runs = operator.metric("kvpilot_operator_warmups_total", namespace=ns, result="Succeeded")
    warm_pods = operator.metric("kvpilot_operator_warmup_pods_total", namespace=ns, verified="warm")

    spec = {
        "targetRef": {"name": "llm"},
        "promptsFrom": {"configMapKeyRef": {"name": "prompts", "key": "prompts.yaml"}},
        "pin": True,
    }
    apply_ns(cluster, ns, pcw("warm", spec))
    obj = wait_done(cluster, ns, "warm")
    st = obj["status"]
    assert (st["phase"], st["targets"], st["succeeded"], st["warm"], st["prompts"]) == (
        "Succeeded",
        2,
        2,
        "2/2",
        2,
    ), st
    assert condition(obj, "Complete")[:2] == ("True", "AllPodsWarmed")
    assert condition(obj, "Warm")[:2] == ("True", "AllWarm"), condition(obj, "Warm")
    for entry in st["pods"]:
        assert entry["name"] in pods and entry["verified"] == "warm", entry
        assert (entry["promptsWarm"], entry["ranks"], entry["blockSize"]) == (2, 1, 16), entry
        assert 0 < entry["cachedTokens"] < entry["promptTokens"], entry
        # the daemon's answer to pin_prefix, whatever it is (pins are the daemon's own tests' business)
        assert set(entry["pin"]) >= {"pinned", "blocks"}, entry
    # the caches really hold the prompts: the same requests are served from cache on every pod
    for name, ip in pods.items():
        for prompt in PROMPTS:
            assert cached(ip, prompt) > 0, f"{name}: {prompt}"
    out = cluster.kubectl("get", "pcw", "warm", "-n", ns).stdout.splitlines()
    assert out[0].split()[:4] == ["NAME", "TARGET", "PHASE", "WARM"], out
    assert out[1].split()[1:4] == ["InferenceDeployment/llm", "Succeeded", "2/2"], out
    assert operator.metric("kvpilot_operator_warmups_total", namespace=ns, result="Succeeded") == runs + 1
    assert (
        operator.metric("kvpilot_operator_warmup_pods_total", namespace=ns, verified="warm") == warm_pods + 2
    )
    events = cluster.kubectl("get", "events", "-n", ns, "--field-selector", "involvedObject.name=warm").stdout
    assert "Started" in events and "Succeeded" in events

    # A reset empties the caches (proven cold by its canary; the document, asked once, is not served from
    # cache on the first pod) and a new warm-up fills them again.
    apply_ns(cluster, ns, pcr("flush", {"targetRef": {"name": "llm"}}))
    cluster.kubectl("wait", "--for=condition=Complete", "pcr/flush", "-n", ns, "--timeout=120s")
    flushed = cluster.kubectl_json("get", "pcr", "flush", "-n", ns)
    assert flushed["status"]["verified"] == "2/2", flushed["status"]
    first = sorted(pods)[0]
    assert cached(pods[first], PROMPTS[1]) == 0
    apply_ns(cluster, ns, pcw("warm-again", spec))
    again = wait_done(cluster, ns, "warm-again")
    assert (again["status"]["phase"], again["status"]["warm"]) == ("Succeeded", "2/2"), again["status"]
    assert condition(again, "Warm")[0] == "True"
    for name, ip in pods.items():
        assert cached(ip, PROMPTS[0]) > 0, name

    # docs/warmup.md's script, as written, with kubectl's namespace the test's and a short benchmark: a verified
    # reset, a verified warm-up of examples/warmup-prompts.yaml, then `kvpilot bench --no-reset` on the fleet.
    kubeconfig = tmp_path / "kubeconfig"
    shutil.copy(cluster.kubeconfig, kubeconfig)
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    cluster.kubectl("config", f"--kubeconfig={kubeconfig}", "set-context", "--current", f"--namespace={ns}")
    short = ["--concurrency", "1", "--rounds", "1", "--min-requests", "2", "--max-tokens", "2"]
    r = subprocess.run(
        ["bash", "examples/warmup-before-benchmark.sh", *short],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    resets = [
        p for p in cluster.kubectl_json("get", "pcr", "-n", ns)["items"] if p["metadata"]["name"] != "flush"
    ]
    assert [(p["status"]["phase"], p["status"]["verified"]) for p in resets] == [("Succeeded", "2/2")], resets
    (made,) = [
        w for w in cluster.kubectl_json("get", "pcw", "-n", ns)["items"] if w["metadata"].get("generateName")
    ]
    assert (made["status"]["phase"], made["status"]["warm"]) == ("Succeeded", "2/2"), made["status"]
    assert "prefix cache not reset (--no-reset)" in r.stdout and "\nall runs:\n" in r.stdout, r.stdout


def test_a_fleet_that_caches_nothing_is_not_warm(
    cluster: Cluster, ns: str, operator: OperatorProcess
) -> None:
    env = [{"name": "STANDIN_BLOCK_SIZE", "value": "16"}, {"name": "STANDIN_FORGET", "value": "1"}]
    standin_fleet(cluster, ns, "forgetful", replicas=2, env=env)
    cold_before = operator.metric("kvpilot_operator_warmup_pods_total", namespace=ns, verified="cold")
    apply_ns(cluster, ns, pcw("cold", {"targetRef": {"name": "forgetful"}, "prompts": PROMPTS}))
    obj = wait_done(cluster, ns, "cold", 90)
    st = obj["status"]
    assert (st["phase"], st["failed"], st["warm"], st["coldPods"]) == ("Failed", 2, "0/2", 2), st
    assert condition(obj, "Failed")[:2] == ("True", "NotWarm")
    status, reason, message = condition(obj, "Warm")
    assert (status, reason) == ("False", "NotWarm") and "2/2 pods not warm" in message, message
    assert all(p["reason"] == "NotWarm" and "0 of" in p["verification"] for p in st["pods"]), st["pods"]
    assert (
        operator.metric("kvpilot_operator_warmup_pods_total", namespace=ns, verified="cold")
        == cold_before + 2
    )


def wait_status(cluster: Cluster, ns: str, name: str, what: str, test, timeout: float = 90) -> dict:
    def ok() -> dict | None:
        obj = cluster.kubectl_json("get", "pcw", name, "-n", ns)
        return obj if test(obj.get("status") or {}) else None

    return wait_for(ok, timeout, f"PrefixCacheWarmup {ns}/{name}: {what}", interval=0.5)  # type: ignore[return-value]


def test_a_continuous_warmup_warms_a_pod_that_joins_and_every_pod_again_after_a_reset(
    cluster: Cluster, ns: str, operator: OperatorProcess
) -> None:
    # stand-ins that cache what they are sent (full blocks of 16) until a reset, and take 2 s to start
    env = [{"name": "STANDIN_BLOCK_SIZE", "value": "16"}, {"name": "STANDIN_LOAD_SECONDS", "value": "2"}]
    standin_fleet(cluster, ns, "keep", replicas=2, env=env)
    joined = operator.metric("kvpilot_operator_warmup_reapplies_total", namespace=ns, trigger="podJoined")
    after_reset = operator.metric("kvpilot_operator_warmup_reapplies_total", namespace=ns, trigger="reset")
    apply_ns(
        cluster, ns, pcw("keep", {"targetRef": {"name": "keep"}, "prompts": PROMPTS, "mode": "Continuous"})
    )
    st = wait_status(
        cluster, ns, "keep", "2/2 warm", lambda st: st.get("phase") == "Watching" and st.get("warm") == "2/2"
    )["status"]
    assert (st["targets"], st["passes"], st["lastTrigger"]) == (2, 1, "podJoined"), st
    assert "completionTime" not in st, st
    two = {p["metadata"]["name"]: p["status"]["podIP"] for p in fleet_pods(cluster, ns, "keep")}
    assert {e["name"] for e in st["pods"]} == set(two) and all(e["verified"] == "warm" for e in st["pods"])
    out = cluster.kubectl("get", "pcw", "keep", "-n", ns).stdout.splitlines()
    assert out[1].split()[1:4] == ["InferenceDeployment/keep", "Watching", "2/2"], out

    # scaled from 2 to 3: the new pod is warmed once it is up, by the warm-up that is still watching
    cluster.kubectl("patch", "infd", "keep", "-n", ns, "--type=merge", "-p", '{"spec":{"replicas":3}}')
    obj = wait_status(cluster, ns, "keep", "3/3 warm", lambda st: st.get("warm") == "3/3")
    st = obj["status"]
    three = {p["metadata"]["name"]: p["status"]["podIP"] for p in fleet_pods(cluster, ns, "keep")}
    (new,) = set(three) - set(two)
    assert (st["targets"], st["passes"], st["lastTrigger"]) == (3, 2, "podJoined"), st
    entry = next(e for e in st["pods"] if e["name"] == new)
    assert (entry["verified"], entry["promptsWarm"]) == ("warm", 2), entry
    assert condition(obj, "Warm")[:2] == ("True", "AllWarm")
    assert cached(three[new], PROMPTS[1]) > 0  # the new pod's cache really holds the prompts
    assert (
        operator.metric("kvpilot_operator_warmup_reapplies_total", namespace=ns, trigger="podJoined")
        == joined + 3
    )

    # a reset of the fleet empties every pod (its canary proves each cold); the warm-up then re-applies
    apply_ns(cluster, ns, pcr("flush", {"targetRef": {"name": "keep"}}))
    cluster.kubectl("wait", "--for=condition=Complete", "pcr/flush", "-n", ns, "--timeout=120s")
    assert cluster.kubectl_json("get", "pcr", "flush", "-n", ns)["status"]["verified"] == "3/3"
    obj = wait_status(
        cluster,
        ns,
        "keep",
        "warmed after the reset",
        lambda st: st.get("passes") == 3 and st.get("warm") == "3/3",
    )
    assert obj["status"]["lastTrigger"] == "reset", obj["status"]
    assert condition(obj, "Warm")[:2] == ("True", "AllWarm")
    for name, ip in three.items():
        assert cached(ip, PROMPTS[1]) > 0, name
    assert (
        operator.metric("kvpilot_operator_warmup_reapplies_total", namespace=ns, trigger="reset")
        == after_reset + 3
    )
    assert (
        operator.metric("kvpilot_operator_warmup_oldest_cold_pod_seconds", namespace=ns, warmup="keep") == 0
    )
    assert 'warmup="keep"' in operator.metrics()

    # deleting it stops it: the operator lets go (its finalizer), and its gauge goes
    cluster.kubectl("delete", "pcw", "keep", "-n", ns, "--timeout=30s")
    wait_for(lambda: 'warmup="keep"' not in operator.metrics(), 30, "the warm-up's gauge to go")


def test_a_continuous_warmup_that_cannot_keep_a_pod_warm_says_so_and_counts_its_cold_time(
    cluster: Cluster, ns: str, operator: OperatorProcess
) -> None:
    env = [{"name": "STANDIN_BLOCK_SIZE", "value": "16"}, {"name": "STANDIN_FORGET", "value": "1"}]
    standin_fleet(cluster, ns, "numb", replicas=1, env=env)
    apply_ns(
        cluster, ns, pcw("numb", {"targetRef": {"name": "numb"}, "prompts": PROMPTS, "mode": "Continuous"})
    )
    obj = wait_status(cluster, ns, "numb", "a pass", lambda st: st.get("passes") == 1)
    assert (obj["status"]["phase"], obj["status"]["warm"], obj["status"]["coldPods"]) == (
        "Watching",
        "0/1",
        1,
    )
    assert condition(obj, "Warm")[:2] == ("False", "NotWarm")
    wait_for(
        lambda: (
            operator.metric("kvpilot_operator_warmup_oldest_cold_pod_seconds", namespace=ns, warmup="numb")
            >= 3
        ),
        30,
        "the cold pod's time to count",
    )


def _cond(pod: dict, type_: str) -> dict:
    return next((c for c in pod["status"].get("conditions") or [] if c["type"] == type_), {})


def test_a_gating_warmup_keeps_a_new_pod_out_of_the_service_until_it_is_warm(
    cluster: Cluster, ns: str, operator: OperatorProcess
) -> None:
    # Each completion takes 1.5 s: the new pod's warm-up holds it, containers ready but not Ready, for
    # longer than the polls below take to see it (answered at once, the pod went from ContainersReady to
    # warm and Ready within one second and between two polls, and the gate could not be shown to hold).
    env = [
        {"name": "STANDIN_BLOCK_SIZE", "value": "16"},
        {"name": "STANDIN_LOAD_SECONDS", "value": "2"},
        {"name": "STANDIN_COMPLETION_DELAY", "value": "1.5"},
    ]
    standin_fleet(cluster, ns, "gated", replicas=2, env=env)
    spec = {"targetRef": {"name": "gated"}, "prompts": PROMPTS, "mode": "Continuous", "gateReadiness": True}
    apply_ns(cluster, ns, pcw("gate", spec))

    # the fleet's pod template gains the readiness gate (a rollout): its new pods are Ready once warmed
    def gated_and_ready() -> bool:
        pods = fleet_pods(cluster, ns, "gated")
        return len(pods) == 2 and all(
            p["spec"].get("readinessGates") == [{"conditionType": "kvpilot.io/warm"}]
            and _cond(p, "Ready").get("status") == "True"
            for p in pods
        )

    wait_for(
        gated_and_ready, 120, "the fleet rolled out with the gate, its pods warmed and Ready", interval=1
    )
    two = {p["metadata"]["name"] for p in fleet_pods(cluster, ns, "gated")}
    for p in fleet_pods(cluster, ns, "gated"):
        assert (_cond(p, "kvpilot.io/warm")["status"], _cond(p, "kvpilot.io/warm")["reason"]) == (
            "True",
            "Warm",
        )

    # scaled to 3: the new pod runs, but is neither Ready nor a ready endpoint of the Service until warm
    cluster.kubectl("patch", "infd", "gated", "-n", ns, "--type=merge", "-p", '{"spec":{"replicas":3}}')
    held = 0
    new = ""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        pods = {p["metadata"]["name"]: p for p in fleet_pods(cluster, ns, "gated")}
        fresh = [n for n in pods if n not in two]
        if not fresh:
            time.sleep(0.2)
            continue
        new = fresh[0]
        # the Service's endpoints read before the pod: a pod seen not warm was not warm when they were read
        endpoints = service_endpoints(cluster, ns, "gated")
        pod = {p["metadata"]["name"]: p for p in fleet_pods(cluster, ns, "gated")}.get(new)
        if pod is None:
            continue
        if _cond(pod, "kvpilot.io/warm").get("status") == "True":
            break
        running = any("running" in c["state"] for c in pod["status"].get("containerStatuses") or [])
        assert _cond(pod, "Ready").get("status") != "True", pod["status"]
        assert not endpoints.get(new), endpoints
        held += running and bool(_cond(pod, "ContainersReady").get("status") == "True")
        time.sleep(0.2)
    assert new, "no new pod"
    wait_for(lambda: service_endpoints(cluster, ns, "gated").get(new), 30, "the warm pod in the Service")
    pod = next(p for p in fleet_pods(cluster, ns, "gated") if p["metadata"]["name"] == new)
    ready, warmed = (
        _cond(pod, "Ready")["lastTransitionTime"],
        _cond(pod, "kvpilot.io/warm")["lastTransitionTime"],
    )
    assert ready >= warmed, pod["status"]["conditions"]
    # the gate held it: seen with its containers ready yet not Ready, or Ready only after ContainersReady (a
    # gate-blind node makes both true at once); times are to the second, so either proves it
    assert held > 0 or ready > _cond(pod, "ContainersReady")["lastTransitionTime"], pod["status"][
        "conditions"
    ]
    st = cluster.kubectl_json("get", "pcw", "gate", "-n", ns)["status"]
    assert next(e for e in st["pods"] if e["name"] == new)["verified"] == "warm", st

    # deleting it opens every gate, and the template loses the gate (pods without it roll out)
    cluster.kubectl("delete", "pcw", "gate", "-n", ns, "--timeout=30s")

    def ungated() -> bool:
        pods = fleet_pods(cluster, ns, "gated")
        return ready_replicas(cluster, ns, "gated", 3) and all(
            not p["spec"].get("readinessGates") for p in pods
        )

    wait_for(ungated, 120, "the fleet rolled out without the gate", interval=1)


@pytest.mark.timeout(900)  # three real daemons to load
def test_real_daemons_scaled_from_2_to_3_are_routed_to_only_warm_and_warmed_again_after_a_reset(
    cluster: Cluster, ns: str, operator: OperatorProcess
) -> None:
    """Issue 45's case through real daemons: a gating Continuous warm-up made before its fleet (so the fleet's
    first pods carry the gate: no rollout), the fleet scaled from 2 to 3. The new pod's first request, sent the
    moment it is a ready endpoint of the Service (what the fleet router and kube-proxy route by), is served from
    cache: only the warm-up can have sent it those prompts, so it was warm before it was routed to. A reset of
    the fleet then empties every pod and the warm-up re-applies."""
    spec = {
        "targetRef": {"name": "real"},
        "prompts": PROMPTS,
        "mode": "Continuous",
        "gateReadiness": True,
        "waitForTarget": True,
    }
    apply_ns(cluster, ns, pcw("gate", spec))
    engine = {"kvCacheBlocks": 256, "maxNumSeqs": 4, "maxModelLen": 512}
    apply_ns(cluster, ns, fleet("real", {"replicas": 2, "engine": engine}))
    wait_for(lambda: ready_replicas(cluster, ns, "real", 2), 400, "2 warm, Ready daemons", interval=1)
    two = {p["metadata"]["name"] for p in fleet_pods(cluster, ns, "real")}
    assert all(
        p["spec"].get("readinessGates") == [{"conditionType": "kvpilot.io/warm"}]
        for p in fleet_pods(cluster, ns, "real")
    )

    cluster.kubectl("patch", "infd", "real", "-n", ns, "--type=merge", "-p", '{"spec":{"replicas":3}}')

    def routed_new_pod() -> dict | None:
        ready = {n for n, ok in service_endpoints(cluster, ns, "real").items() if ok}
        fresh = [p for p in fleet_pods(cluster, ns, "real") if p["metadata"]["name"] not in two]
        return fresh[0] if fresh and fresh[0]["metadata"]["name"] in ready else None

    new = wait_for(routed_new_pod, 400, "the new pod a ready endpoint", interval=0.2)
    first = cached(new["status"]["podIP"], PROMPTS[1])  # type: ignore[index]
    assert first > 0, "the new pod's first routed request found nothing cached: it was routed to cold"
    st = cluster.kubectl_json("get", "pcw", "gate", "-n", ns)["status"]
    entry = next(e for e in st["pods"] if e["name"] == new["metadata"]["name"])  # type: ignore[index]
    assert entry["verified"] == "warm", entry

    apply_ns(cluster, ns, pcr("flush", {"targetRef": {"name": "real"}}))
    cluster.kubectl("wait", "--for=condition=Complete", "pcr/flush", "-n", ns, "--timeout=120s")
    assert cluster.kubectl_json("get", "pcr", "flush", "-n", ns)["status"]["verified"] == "3/3"
    wait_status(
        cluster,
        ns,
        "gate",
        "re-warmed after the reset",
        lambda st: "reset" in (st.get("lastTrigger") or "") and st.get("warm") == "3/3",
        timeout=120,
    )
    for p in fleet_pods(cluster, ns, "real"):
        assert cached(p["status"]["podIP"], PROMPTS[0]) > 0, p["metadata"]["name"]


def test_prompts_that_cannot_be_read_and_no_pods_fail_with_a_reason(
    cluster: Cluster, ns: str, operator: OperatorProcess
) -> None:
    ref = {"configMapKeyRef": {"name": "nope", "key": "prompts.yaml"}}
    apply_ns(cluster, ns, pcw("missing", {"selector": {"matchLabels": {"app": "x"}}, "promptsFrom": ref}))
    prompts_config_map(cluster, ns, "broken", "- &a {prompt: x}\n- *a\n")
    broken = {"configMapKeyRef": {"name": "broken", "key": "prompts.yaml"}}
    apply_ns(cluster, ns, pcw("broken", {"selector": {"matchLabels": {"app": "x"}}, "promptsFrom": broken}))
    none = {"selector": {"matchLabels": {"app": "x"}}, "prompts": PROMPTS}
    apply_ns(cluster, ns, pcw("none", none))
    apply_ns(cluster, ns, pcw("expires", {**none, "allowNoTargets": True, "ttlSecondsAfterFinished": 0}))
    for name, reason, words in (
        ("missing", "PromptsNotFound", f"ConfigMap {ns}/nope (spec.promptsFrom) not found"),
        ("broken", "InvalidPrompts", "aliases"),
        ("none", "NoTargets", "no pod matched"),
    ):
        obj = wait_done(cluster, ns, name, 60)
        assert obj["status"]["phase"] == "Failed", obj["status"]
        status, got, message = condition(obj, "Failed")
        assert (status, got) == ("True", reason) and words in message, (name, message)
    wait_for(
        lambda: cluster.kubectl("get", "pcw", "expires", "-n", ns, check=False).returncode != 0,
        60,
        "the finished warm-up to expire",
    )


BAD_SPECS = [
    (
        {"targetRef": {"name": "a"}, "selector": {"matchLabels": {"a": "b"}}, "prompts": PROMPTS},
        "exactly one of targetRef",
    ),
    ({"targetRef": {"name": "a"}}, "exactly one of prompts and promptsFrom"),
    (
        {
            "targetRef": {"name": "a"},
            "prompts": PROMPTS,
            "promptsFrom": {"configMapKeyRef": {"name": "c", "key": "k"}},
        },
        "exactly one of prompts and promptsFrom",
    ),
    (
        {"targetRef": {"name": "a"}, "prompts": PROMPTS, "mode": "Always"},
        'Unsupported value: "Always"',
    ),
    (
        {"targetRef": {"name": "a"}, "prompts": PROMPTS, "gateReadiness": True},
        "gateReadiness is for mode Continuous",
    ),
    (
        {
            "selector": {"matchLabels": {"a": "b"}},
            "prompts": PROMPTS,
            "mode": "Continuous",
            "gateReadiness": True,
        },
        "gateReadiness is for mode Continuous",
    ),
    (
        {"targetRef": {"name": "a"}, "prompts": PROMPTS, "mode": "Continuous", "ttlSecondsAfterFinished": 5},
        "ttlSecondsAfterFinished is for mode Once",
    ),
    ({"targetRef": {"name": "a"}, "prompts": [{}]}, "each prompt is either messages"),
    (
        {"targetRef": {"name": "a"}, "prompts": [{"prompt": "x", "messages": PROMPTS[0]["messages"]}]},
        "each prompt",
    ),
    (
        {"targetRef": {"name": "a"}, "prompts": [{"messages": [{"role": "robot", "content": "x"}]}]},
        'Unsupported value: "robot"',
    ),
    ({"targetRef": {"name": "a"}, "prompts": []}, "spec.prompts"),
    ({"targetRef": {"name": "a"}, "prompts": [{"prompt": "x"}] * 65}, "spec.prompts: Too many"),
    ({"targetRef": {"name": "a"}, "prompts": [{"prompt": "x" * 65537}]}, "spec.prompts[0].prompt: Too long"),
    (
        {"selector": {"matchLabels": {"a": "b"}}, "engine": "vllm", "pin": True, "prompts": PROMPTS},
        "pin is for kvpilot pods",
    ),
    (
        {"selector": {"matchLabels": {"a": "b"}}, "waitForTarget": True, "prompts": PROMPTS},
        "waitForTarget is for targetRef",
    ),
    (
        {"targetRef": {"name": "a"}, "adminTokenSecretRef": {"name": "s"}, "prompts": PROMPTS},
        "adminTokenSecretRef is for selector warm-ups only",
    ),
    (
        {"targetRef": {"name": "a"}, "promptsFrom": {"configMapKeyRef": {"name": "c"}}},
        "spec.promptsFrom.configMapKeyRef.key",
    ),
    ({"selector": {}, "prompts": PROMPTS}, "selector must not be empty"),
    ({"targetRef": {"name": "a"}, "prompts": PROMPTS, "timeoutSeconds": 0}, "spec.timeoutSeconds"),
]


def test_bad_warmup_specs_are_refused_by_the_api_server(
    cluster: Cluster, namespace: str, operator_kubeconfig
) -> None:
    ns = namespace
    for i, (spec, message) in enumerate(BAD_SPECS):
        obj = pcw(f"bad-{i}", spec)
        obj["metadata"]["namespace"] = ns
        r = cluster.kubectl("apply", "-f", "-", input=json.dumps(obj), check=False)
        assert r.returncode != 0, f"case {i} was accepted: {spec}"
        assert message in r.stderr, f"case {i}: {r.stderr}"
    apply_ns(cluster, ns, pcw("fixed", {"selector": {"matchLabels": {"none": "x"}}, "prompts": PROMPTS}))
    got = cluster.kubectl_json("get", "pcw", "fixed", "-n", ns)["spec"]
    assert (got["mode"], got["pin"], got["timeoutSeconds"], got["engine"]) == ("Once", False, 300, "kvpilot")
    r = cluster.kubectl(
        "patch", "pcw", "fixed", "-n", ns, "--type=merge", "-p", '{"spec":{"maxConcurrency":2}}', check=False
    )
    assert r.returncode != 0 and "spec is immutable" in r.stderr
    assert "pin_prefix" in cluster.kubectl("explain", "pcw.spec.pin").stdout
    # the examples are specs the API server takes (and the prompts' ConfigMap a list the operator reads)
    for example in ("warmup-prompts.yaml", "prefixcachewarmup.yaml"):
        cluster.kubectl("create", "--dry-run=server", "-n", ns, "-f", str(ROOT / "examples" / example))
    cm = yaml.safe_load((ROOT / "examples" / "warmup-prompts.yaml").read_text())
    assert len(warm_prompts.parse(cm["data"]["prompts.yaml"])) == 2
