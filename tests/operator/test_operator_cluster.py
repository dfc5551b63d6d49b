"""The operator against the real dev cluster: real kube-apiserver and controllers, pods as processes, the
operator as a subprocess with only the RBAC rules of kvpilot.operator.rbac, real `kvpilot serve` daemons
for the headline test and stand-in daemons (standin.py) where the model is not the point."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from kvpilot.operator import rbac
from kvpilot.operator.fleets.targets import starting
from support.cluster import Cluster, host_folders
from support.operator import (
    OP_NS,
    OperatorProcess,
    apply_ns,
    cached_tokens,
    fleet,
    fleet_pods,
    http,
    infd,
    pcr,
    pods_by_name,
    ready_replicas,
    reset_status,
    standin_deployment,
    standin_fleet,
    standin_pod,
    standin_spec,
    wait_phase,
)
from support.procs import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def wait_deployment_ready(cluster: Cluster, ns: str, name: str, n: int, timeout: float = 90) -> None:
    def ok() -> bool:
        st = cluster.kubectl_json("get", "deployment", name, "-n", ns).get("status") or {}
        return st.get("readyReplicas") == n and st.get("replicas") == n

    wait_for(ok, timeout, f"deployment {ns}/{name} with {n} ready pods")


def pod_ips(cluster: Cluster, ns: str, selector: str) -> dict[str, str]:
    items = cluster.kubectl_json("get", "pods", "-n", ns, "-l", selector)["items"]
    return {
        p["metadata"]["name"]: p["status"]["podIP"]
        for p in items
        if not p["metadata"].get("deletionTimestamp")
    }


def standin_pods(
    cluster: Cluster, ns: str, name: str, replicas: int, env: list | None = None
) -> dict[str, str]:
    """A stand-in Deployment (standin_deployment) in `ns`, waited for until ready; pod name -> IP."""
    apply_ns(cluster, ns, standin_deployment(name, replicas, {}, env))
    wait_deployment_ready(cluster, ns, name, replicas)
    return pod_ips(cluster, ns, f"app={name}")


# --------------------------------------------------------------------------------------------------------
def test_reset_three_real_daemons(
    cluster: Cluster, ns: str, operator: OperatorProcess, lora_adapters: dict[str, Path]
) -> None:
    cluster.kubectl("create", "secret", "generic", "admin", "-n", ns, "--from-literal=token=s3cret-admin")
    cluster.kubectl("label", "secret", "admin", "-n", ns, "kvpilot.io/admin-token=true")  # its owner consents
    apply_ns(
        cluster,
        ns,
        fleet(
            "llm",
            {
                "replicas": 3,
                "adminTokenSecretRef": {"name": "admin"},
                "engine": {
                    "kvCacheBlocks": 256,
                    "maxNumSeqs": 4,
                    "maxModelLen": 512,
                    "lora": {"modules": [{"name": "sql", "path": str(lora_adapters["every-layer"])}]},
                },
                **host_folders(lora_adapters["every-layer"]),
            },
        ),
    )
    wait_for(lambda: ready_replicas(cluster, ns, "llm", 3), 300, "3 ready kvpilot daemons", interval=1)
    obj = infd(cluster, ns, "llm")
    conds = {c["type"]: c["status"] for c in obj["status"]["conditions"]}
    assert conds == {"Available": "True", "Progressing": "False", "Degraded": "False", "Ready": "True"}
    assert obj["status"]["selector"] == "kvpilot.io/inference-deployment=llm"
    pods = {p["metadata"]["name"]: p["status"]["podIP"] for p in fleet_pods(cluster, ns, "llm")}
    assert len(pods) == 3
    # The daemons require the admin token the operator reads from the same Secret.
    with pytest.raises(urllib.error.HTTPError) as e:
        http("POST", f"http://{next(iter(pods.values()))}:8000/reset_prefix_cache")
    assert e.value.code == 401

    epochs = {}
    for name, ip in pods.items():
        cached_tokens(ip)
        assert cached_tokens(ip) > 0, f"{name}: the second request should hit the warm cache"
        epochs[name] = http("GET", f"http://{ip}:8000/prefix_cache")["epoch"]
    resets_before = operator.metric("kvpilot_operator_resets_total", namespace=ns, result="Succeeded")
    calls_before = operator.metric("kvpilot_operator_reset_pod_requests_total", result="Succeeded")
    cold_before = operator.metric("kvpilot_operator_reset_verifications_total", namespace=ns, verdict="cold")

    apply_ns(cluster, ns, pcr("flush", {"targetRef": {"name": "llm"}}))
    cluster.kubectl("wait", "--for=condition=Complete", "pcr/flush", "-n", ns, "--timeout=120s")
    r = cluster.kubectl_json("get", "pcr", "flush", "-n", ns)
    st = r["status"]
    assert (st["phase"], st["targets"], st["succeeded"], st["failed"], st["progress"]) == (
        "Succeeded",
        3,
        3,
        0,
        "3/3",
    )
    # spec.verify by default: each pod's canary was served from cache before the reset, and not after it
    assert (st["verified"], st["verifiedCold"], st["verifiedWarm"], st["verifiedUnknown"]) == ("3/3", 3, 0, 0)
    verified = next(c for c in st["conditions"] if c["type"] == "Verified")
    assert (verified["status"], verified["reason"]) == ("True", "AllCold"), verified
    for name, ip in pods.items():
        rec = pods_by_name(r)[name]
        assert rec["result"] == "Succeeded" and rec["httpStatus"] == 200 and rec["attempts"] == 1
        assert rec["verified"] == "cold" and "found nothing cached" in rec["verification"], rec
        assert "pool" in rec["cleared"] and "reason" not in rec, rec
        now = http("GET", f"http://{ip}:8000/prefix_cache")["epoch"]
        assert rec["epoch"] == now == epochs[name] + 1
        assert cached_tokens(ip) == 0, f"{name}: nothing cached before the reset may be reused"
    assert (
        operator.metric("kvpilot_operator_resets_total", namespace=ns, result="Succeeded")
        == resets_before + 1
    )
    assert (
        operator.metric("kvpilot_operator_reset_pod_requests_total", result="Succeeded") >= calls_before + 3
    )
    assert (
        operator.metric("kvpilot_operator_reset_verifications_total", namespace=ns, verdict="cold")
        == cold_before + 3
    )
    assert infd(cluster, ns, "llm")["status"]["lastReset"]["name"] == "flush"
    assert operator.metric("kvpilot_operator_ready_replicas", namespace=ns, deployment="llm") == 3
    assert operator.metric("kvpilot_operator_desired_replicas", namespace=ns, deployment="llm") == 3
    assert operator.metric("kvpilot_operator_resets_in_progress") == 0
    assert 'kvpilot_operator_reconcile_errors_total{kind="PrefixCacheReset"}' in operator.metrics()
    assert (
        operator.metric("kvpilot_operator_reset_pods", namespace=ns, reset="flush", result="succeeded") == 3
    )
    assert operator.metric("kvpilot_operator_inference_deployments") >= 1
    out = cluster.kubectl("get", "pcr", "flush", "-n", ns).stdout
    # TARGET PHASE TARGETS SUCCEEDED FAILED SKIPPED: counts by default; VERIFIED: cold of those reset
    assert out.splitlines()[0].split()[7] == "VERIFIED", out
    assert out.splitlines()[1].split()[1:8] == [
        "InferenceDeployment/llm",
        "Succeeded",
        "3",
        "3",
        "0",
        "0",
        "3/3",
    ], out
    events = cluster.kubectl(
        "get", "events", "-n", ns, "--field-selector", "involvedObject.name=flush"
    ).stdout
    assert "Started" in events and "Succeeded" in events

    # spec.scope: one salt's blocks on every pod, proven cold by a canary under that salt; the rest stays warm
    for ip in pods.values():
        for salt in ("tenant-x", None, "tenant-x", None):
            cached_tokens(ip, salt)
    apply_ns(cluster, ns, pcr("tenant-x", {"targetRef": {"name": "llm"}, "scope": {"cacheSalt": "tenant-x"}}))
    cluster.kubectl("wait", "--for=condition=Complete", "pcr/tenant-x", "-n", ns, "--timeout=120s")
    st = cluster.kubectl_json("get", "pcr", "tenant-x", "-n", ns)["status"]
    assert (st["phase"], st["succeeded"], st["verified"]) == ("Succeeded", 3, "3/3"), st
    for ip in pods.values():
        assert cached_tokens(ip, "tenant-x") == 0 and cached_tokens(ip) > 0

    # scope.loraName: the adapter spec.engine.lora serves, reset on every pod; the base model stays warm
    for ip in pods.values():
        for model in ("sql", None, "sql"):
            cached_tokens(ip, model=model)
    apply_ns(cluster, ns, pcr("sql", {"targetRef": {"name": "llm"}, "scope": {"loraName": "sql"}}))
    cluster.kubectl("wait", "--for=condition=Complete", "pcr/sql", "-n", ns, "--timeout=120s")
    st = cluster.kubectl_json("get", "pcr", "sql", "-n", ns)["status"]
    assert (st["phase"], st["succeeded"], st["verified"]) == ("Succeeded", 3, "3/3"), st
    for ip in pods.values():
        assert cached_tokens(ip, model="sql") == 0 and cached_tokens(ip) > 0


def test_failed_skipped_and_not_supported_pods(cluster: Cluster, ns: str) -> None:
    for name, env in [
        ("ok", []),
        ("bad", [{"name": "STANDIN_RESET_STATUS", "value": "500"}]),
        ("nosup", [{"name": "STANDIN_RESET_STATUS", "value": "501"}]),
        ("slow", [{"name": "STANDIN_DELAY", "value": "30"}]),
    ]:
        apply_ns(cluster, ns, standin_deployment(name, 2 if name == "ok" else 1, {"fleet": "mixed"}, env))
    for name in ("ok", "bad", "nosup", "slow"):
        wait_deployment_ready(cluster, ns, name, 2 if name == "ok" else 1)
    t0 = time.monotonic()
    apply_ns(
        cluster,
        ns,
        pcr(
            "mixed",
            {
                "selector": {"matchLabels": {"fleet": "mixed"}},
                "timeoutSeconds": 20,
                "requestTimeoutSeconds": 15,
                "retriesPerPod": 2,
            },
        ),
    )
    slow = next(iter(pod_ips(cluster, ns, "app=slow")))

    def only_slow_left() -> bool:
        st = reset_status(cluster, ns, "mixed")
        return st.get("targets") == 5 and st.get("pending") == 1

    wait_for(only_slow_left, 30, "every pod but the slow one decided")
    cluster.kubectl("delete", "pod", slow, "-n", ns, "--wait=false")
    r = wait_phase(cluster, ns, "mixed", 40)
    elapsed = time.monotonic() - t0
    pods = pods_by_name(r)
    results = sorted(p["result"] for p in pods.values())
    assert results == ["Failed", "NotSupported", "Skipped", "Succeeded", "Succeeded"], pods
    bad = next(p for p in pods.values() if p["result"] == "Failed")
    assert bad["httpStatus"] == 500 and "rank 0" in bad["message"] and bad["attempts"] == 3
    nosup = next(p for p in pods.values() if p["result"] == "NotSupported")
    assert nosup["httpStatus"] == 501 and nosup["attempts"] == 1
    assert pods[slow]["result"] == "Skipped" and "pod" in pods[slow]["message"]
    st = r["status"]
    assert st["phase"] == "Failed"
    assert (st["succeeded"], st["failed"], st["skipped"], st["notSupported"]) == (2, 1, 1, 1)
    assert elapsed < 20 + 10, f"took {elapsed:.1f}s with timeoutSeconds 20"
    cond = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert cond["status"] == "True" and cond["reason"] == "PodsFailed" and bad["name"] in cond["message"]
    assert set(cond) == {"type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"}
    events = cluster.kubectl(
        "get", "events", "-n", ns, "--field-selector", "involvedObject.name=mixed"
    ).stdout
    assert "PodResetFailed" in events


def test_a_pod_still_loading_its_model_is_waited_for_not_failed(cluster: Cluster, ns: str) -> None:
    """Issue 42's trip: `kubectl wait` says the fleet is Available while its second pod still loads its
    model; a reset then got "connection refused" and ended Failed. A pod not Ready since its engine started
    is waited for and reset once up; one that outlasts the deadline is Skipped (reason Starting)."""
    ready = standin_pods(cluster, ns, "warm", 1, [])
    for name, seconds in (("loading", "6"), ("stuck", "600")):
        apply_ns(
            cluster,
            ns,
            standin_deployment(
                name, 1, {"fleet": "starting"}, [{"name": "STANDIN_LOAD_SECONDS", "value": seconds}]
            ),
        )
    cluster.kubectl("label", "pod", next(iter(ready)), "fleet=starting", "-n", ns)

    def running_not_ready() -> bool:
        items = cluster.kubectl_json("get", "pods", "-n", ns, "-l", "fleet=starting")["items"]
        loading = [p for p in items if p["metadata"]["labels"]["app"] in ("loading", "stuck")]
        return len(loading) == 2 and all(starting(p, None) for p in loading)

    wait_for(running_not_ready, 60, "the loading pods running, not Ready")
    spec = {"selector": {"matchLabels": {"fleet": "starting"}}, "timeoutSeconds": 15, "retriesPerPod": 1}
    apply_ns(cluster, ns, pcr("starting", spec))
    r = wait_phase(cluster, ns, "starting", 60)
    pods = {p["name"].rsplit("-", 2)[0]: p for p in r["status"]["pods"]}
    assert pods["warm"]["result"] == "Succeeded" and pods["loading"]["result"] == "Succeeded", pods
    assert pods["stuck"]["result"] == "Skipped" and pods["stuck"]["reason"] == "Starting", pods["stuck"]
    assert (r["status"]["phase"], r["status"]["skipped"]) == ("Succeeded", 1), r["status"]
    loading_ip = next(iter(pod_ips(cluster, ns, "app=loading").values()))
    assert http("GET", f"http://{loading_ip}:8000/calls")["resets"] == 1


def killed_mid_fanout(cluster: Cluster, ns: str, operator: OperatorProcess, engine: str) -> None:
    """At-least-once: a restarted operator calls the pods again, so every pod ends Succeeded (vLLM-style
    pods too, which report no epoch to tell whether a call in flight took effect)."""
    env = [{"name": "STANDIN_DELAY", "value": "2"}, {"name": "STANDIN_ENGINE", "value": engine}]
    ips = standin_pods(cluster, ns, "slowfleet", 4, env)
    apply_ns(
        cluster,
        ns,
        pcr(
            "crash",
            {
                "selector": {"matchLabels": {"app": "slowfleet"}},
                "maxConcurrency": 1,
                "timeoutSeconds": 120,
                "engine": engine,
            },
        ),
    )

    def one_done() -> bool:
        st = reset_status(cluster, ns, "crash")
        return st.get("phase") == "Running" and st.get("succeeded", 0) >= 1

    wait_for(one_done, 40, "the first pod reset")
    time.sleep(0.5)  # the next call is in flight: the stand-in applies a reset on receipt
    operator.kill()
    assert reset_status(cluster, ns, "crash")["phase"] == "Running"
    # A higher peering priority takes over at once; the killed replica's peering entry has not expired yet.
    operator.start("--priority", str(int(time.time()) % 100000 + 1))
    r = wait_phase(cluster, ns, "crash", 90)
    assert r["status"]["phase"] == "Succeeded" and r["status"]["succeeded"] == 4, r["status"]
    assert all(p["result"] == "Succeeded" for p in r["status"]["pods"])
    resets = {name: http("GET", f"http://{ip}:8000/calls")["resets"] for name, ip in ips.items()}
    assert all(n >= 1 for n in resets.values()), resets  # never fewer than one
    assert sum(resets.values()) >= 5, resets  # the pods done before the crash were called again


def test_kvpilot_fleet_operator_killed_mid_fanout(
    cluster: Cluster, ns: str, operator: OperatorProcess
) -> None:
    killed_mid_fanout(cluster, ns, operator, "kvpilot")


def test_vllm_fleet_operator_killed_mid_fanout(cluster: Cluster, ns: str, operator: OperatorProcess) -> None:
    killed_mid_fanout(cluster, ns, operator, "vllm")


def test_graceful_stop_mid_fanout_is_bounded_and_the_next_operator_finishes(
    cluster: Cluster, ns: str, operator: OperatorProcess
) -> None:
    standin_pods(cluster, ns, "grace", 3, [{"name": "STANDIN_DELAY", "value": "30"}])
    apply_ns(
        cluster,
        ns,
        pcr(
            "g",
            {
                "selector": {"matchLabels": {"app": "grace"}},
                "timeoutSeconds": 300,
                "requestTimeoutSeconds": 60,
            },
        ),
    )
    wait_for(lambda: reset_status(cluster, ns, "g").get("phase") == "Running", 30, "the reset running")
    time.sleep(1)  # the three 30 s calls are in flight
    t0 = time.monotonic()
    operator.stop()  # SIGTERM: calls in flight get the shutdown grace, then the daemon is cancelled
    took = time.monotonic() - t0
    assert took < 14, f"stopping took {took:.1f}s"
    assert operator.proc is not None and operator.proc.returncode is not None
    assert reset_status(cluster, ns, "g")["phase"] == "Running"
    operator.start()
    st = wait_phase(cluster, ns, "g", 120)["status"]
    assert st["phase"] == "Succeeded" and st["succeeded"] == 3, st


def test_reset_running_requests_stays_at_most_once(
    cluster: Cluster, ns: str, operator: OperatorProcess
) -> None:
    """With resetRunningRequests a second call is not harmless: an interrupted reset ends Failed
    (Interrupted) and no pod is called after the restart."""
    ips = standin_pods(cluster, ns, "once", 3, [{"name": "STANDIN_DELAY", "value": "2"}])
    apply_ns(
        cluster,
        ns,
        pcr(
            "rr",
            {
                "selector": {"matchLabels": {"app": "once"}},
                "maxConcurrency": 1,
                "resetRunningRequests": True,
                "timeoutSeconds": 120,
            },
        ),
    )
    wait_for(lambda: reset_status(cluster, ns, "rr").get("phase") == "Running", 30, "the reset running")
    time.sleep(0.5)
    operator.kill()
    before = {name: http("GET", f"http://{ip}:8000/calls")["calls"] for name, ip in ips.items()}
    operator.start("--priority", str(int(time.time()) % 100000 + 1))
    st = wait_phase(cluster, ns, "rr", 60)["status"]
    cond = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert st["phase"] == "Failed" and cond["reason"] == "Interrupted"
    time.sleep(3)  # any call a restarted operator made would have reached the pods by now
    after = {name: http("GET", f"http://{ip}:8000/calls")["calls"] for name, ip in ips.items()}
    assert after == before and max(after.values()) <= 1, (before, after)


BAD_SPECS = [
    (
        "pcr",
        {"targetRef": {"name": "a"}, "selector": {"matchLabels": {"a": "b"}}},
        "exactly one of targetRef and selector",
    ),
    ("pcr", {"engine": "kvpilot"}, "exactly one of targetRef and selector"),
    (
        "pcr",
        {"selector": {"matchLabels": {"a": "b"}}, "engine": "vllm", "scope": {"loraName": "policy"}},
        "scope is for kvpilot pods",
    ),
    ("pcr", {"targetRef": {"name": "a"}, "scope": {}}, "spec.scope"),
    ("pcr", {"targetRef": {"name": "a"}, "scope": {"cacheSalt": ""}}, "spec.scope.cacheSalt"),
    ("pcr", {"targetRef": {"name": "a"}, "maxConcurrency": -1}, "spec.maxConcurrency"),
    ("pcr", {"targetRef": {"name": "a"}, "engine": "trtllm"}, 'Unsupported value: "trtllm"'),
    ("pcr", {"selector": {}}, "selector must not be empty"),
    # terms that only exclude select every other pod of the namespace
    (
        "pcr",
        {"selector": {"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}},
        "must not be empty",
    ),
    (
        "pcr",
        {
            "selector": {
                "matchExpressions": [
                    {"key": "a", "operator": "NotIn", "values": ["x"]},
                    {"key": "b", "operator": "DoesNotExist"},
                ]
            }
        },
        "must not be empty",
    ),
    (
        "pcr",
        {"targetRef": {"name": "a"}, "timeoutSeconds": 10, "requestTimeoutSeconds": 30},
        "requestTimeoutSeconds must not exceed timeoutSeconds",
    ),
    ("pcr", {"selector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}, "In and NotIn need values"),
    ("pcr", {"targetRef": {"name": ""}}, "spec.targetRef.name"),
    ("pcr", {"targetRef": {"name": "a"}, "retriesPerPod": 1000}, "spec.retriesPerPod"),
    ("pcr", {"targetRef": {"name": "Not_A_DNS_Name"}}, "must be a DNS-1123 label"),
    ("pcr", {"targetRef": {"name": "a" * 64}}, "spec.targetRef.name"),
    (
        "pcr",
        {"targetRef": {"name": "a"}, "adminTokenSecretRef": {"name": "other-team"}},
        "adminTokenSecretRef is for selector resets only",
    ),
    ("pcr", {"targetRef": {"name": "a"}, "minSuccessRatio": 1.5}, "spec.minSuccessRatio"),
    ("pcr", {"targetRef": {"name": "a"}, "verify": "yes"}, "spec.verify in body must be of type boolean"),
    (
        "pcr",
        {"targetRef": {"name": "a"}, "resetExternal": 1},
        "spec.resetExternal in body must be of type boolean",
    ),
    ("infd", {"resources": {"limits": {"cpu": "lots"}}}, "spec.resources.limits.cpu"),
    ("infd", {"resources": {"limit": {"cpu": "1"}}}, 'unknown field "spec.resources.limit"'),
    ("infd", {"adminTokenSecretRef": {"name": "x"}, "disableAdminToken": True}, "not both"),
    ("infd", {"replicas": -1}, "spec.replicas"),
    ("infd", {"placement": "StatefulSet"}, 'Unsupported value: "StatefulSet"'),
    ("infd", {"placement": "DaemonSet", "replicas": 3}, "replicas cannot be set with placement DaemonSet"),
    ("infd", {"port": 70000}, "spec.port"),
    ("infd", {"engine": {"blockSize": 17}}, "spec.engine.blockSize"),
    (
        "infd",
        {"engine": {"kvCacheBlocks": 64, "kvCacheMemoryBytes": 1 << 30}},
        "at most one of kvCacheBlocks",
    ),
    ("infd", {"adminTokenSecretRef": {"key": "t"}}, "spec.adminTokenSecretRef.name"),
]


def test_bad_specs_are_refused_by_the_api_server(
    cluster: Cluster, namespace: str, operator_kubeconfig
) -> None:
    ns = namespace
    for i, (kind, spec, message) in enumerate(BAD_SPECS):
        obj = (pcr if kind == "pcr" else fleet)(f"bad-{i}", spec)
        obj["metadata"]["namespace"] = ns
        r = cluster.kubectl("apply", "-f", "-", input=json.dumps(obj), check=False)
        assert r.returncode != 0, f"case {i} was accepted: {spec}"
        assert message in r.stderr, f"case {i}: {r.stderr}"
    # an InferenceDeployment's name becomes a Service name and a label value: 63 characters, DNS-1035
    for bad_name in ("x" * 64, "Upper", "9starts-with-a-digit"):
        r = cluster.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({**fleet(bad_name, {}), "metadata": {"name": bad_name, "namespace": ns}}),
            check=False,
        )
        assert r.returncode != 0 and ("DNS-1035" in r.stderr or "metadata.name" in r.stderr), r.stderr
    # a term that names something the pods carry may come with exclusions
    ok = {"matchExpressions": [{"key": "a", "operator": "Exists"}, {"key": "b", "operator": "DoesNotExist"}]}
    apply_ns(cluster, ns, pcr("narrowed", {"selector": ok}))
    # immutability: a valid reset cannot be edited afterwards
    apply_ns(cluster, ns, pcr("fixed", {"selector": {"matchLabels": {"none": "x"}}}))
    r = cluster.kubectl(
        "patch", "pcr", "fixed", "-n", ns, "--type=merge", "-p", '{"spec":{"maxConcurrency":2}}', check=False
    )
    assert r.returncode != 0 and "spec is immutable" in r.stderr
    # kubectl explain reads the schema's descriptions
    out = cluster.kubectl("explain", "pcr.spec.maxConcurrency").stdout
    assert "Most pods called at the same time" in out
    assert "canary prompt" in cluster.kubectl("explain", "pcr.spec.verify").stdout


def test_fleet_scale_drift_and_service(cluster: Cluster, ns: str) -> None:
    standin_fleet(cluster, ns, "web")
    obj = infd(cluster, ns, "web")
    dep = cluster.kubectl_json("get", "deployment", "web", "-n", ns)
    svc = cluster.kubectl_json("get", "service", "web", "-n", ns)
    for child in (dep, svc):
        ref = child["metadata"]["ownerReferences"][0]
        assert (
            ref["uid"] == obj["metadata"]["uid"]
            and ref["kind"] == "InferenceDeployment"
            and ref["controller"]
        )
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["kvpilot"] and c["args"][0] == "serve"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"

    cluster.kubectl("scale", "infd/web", "-n", ns, "--replicas=3")  # the scale subresource
    wait_for(lambda: ready_replicas(cluster, ns, "web", 3), 90, "scaled to 3")
    scale = (
        cluster.kubectl_json(
            "get", "--raw", f"/apis/kvpilot.io/v1alpha1/namespaces/{ns}/inferencedeployments/web/scale"
        )
        if False
        else json.loads(
            cluster.kubectl(
                "get", "--raw", f"/apis/kvpilot.io/v1alpha1/namespaces/{ns}/inferencedeployments/web/scale"
            ).stdout
        )
    )
    assert (
        scale["spec"]["replicas"] == 3
        and scale["status"]["selector"] == "kvpilot.io/inference-deployment=web"
    )

    # drift: someone scales the Deployment and deletes the Service; both come back
    cluster.kubectl("scale", "deployment/web", "-n", ns, "--replicas=1")
    cluster.kubectl("delete", "service", "web", "-n", ns)
    wait_for(
        lambda: cluster.kubectl_json("get", "deployment", "web", "-n", ns)["spec"]["replicas"] == 3,
        30,
        "the Deployment's replicas put back",
    )
    wait_for(
        lambda: cluster.kubectl("get", "service", "web", "-n", ns, check=False).returncode == 0,
        30,
        "the Service recreated",
    )
    # drift in the pod template: an edited command is put back
    cluster.kubectl(
        "patch",
        "deployment",
        "web",
        "-n",
        ns,
        "--type=json",
        "-p",
        '[{"op":"replace","path":"/spec/template/spec/containers/0/args/0","value":"oops"}]',
    )
    wait_for(
        lambda: (
            cluster.kubectl_json("get", "deployment", "web", "-n", ns)["spec"]["template"]["spec"][
                "containers"
            ][0]["args"][0]
            == "serve"
        ),
        30,
        "the pod template put back",
    )
    # a spec change rolls out
    apply_ns(cluster, ns, fleet("web", {"replicas": 3, **standin_spec(), "engine": {"maxNumSeqs": 3}}))
    wait_for(
        lambda: (
            "--max-num-seqs"
            in cluster.kubectl_json("get", "deployment", "web", "-n", ns)["spec"]["template"]["spec"][
                "containers"
            ][0]["args"]
        ),
        30,
        "the new engine flags in the template",
    )
    wait_for(
        lambda: (
            infd(cluster, ns, "web")["status"].get("observedGeneration")
            == infd(cluster, ns, "web")["metadata"]["generation"]
        ),
        30,
        "observedGeneration",
    )


def test_server_side_apply_removes_what_the_spec_drops_and_never_loops(
    cluster: Cluster, ns: str, operator: OperatorProcess
) -> None:
    spec = {
        "replicas": 1,
        **standin_spec(),
        "nodeSelector": {"pool": "a", "tier": "t1"},
        "resources": {"requests": {"cpu": "0.5"}, "limits": {"cpu": "0.5"}},
    }
    cluster.kubectl("label", "node", "node-1", "pool=a", "tier=t1", "--overwrite")
    apply_ns(cluster, ns, fleet("ssa", spec))

    def template() -> dict:
        return cluster.kubectl_json("get", "deployment", "ssa", "-n", ns)["spec"]["template"]["spec"]

    wait_for(lambda: template()["nodeSelector"].get("pool") == "a", 30, "the Deployment")
    assert template()["containers"][0]["resources"]["limits"]["cpu"] == "500m"  # normalized by the API server
    # someone else's field on our Deployment is kept (server-side apply owns only what we set)
    cluster.kubectl("annotate", "deployment/ssa", "-n", ns, "team.example/owner=ml")
    # a nodeSelector key removed from the spec goes from the Deployment
    apply_ns(cluster, ns, fleet("ssa", {**spec, "nodeSelector": {"pool": "a"}}))
    wait_for(lambda: template()["nodeSelector"] == {"pool": "a"}, 30, "the nodeSelector key removed")
    wait_for(lambda: ready_replicas(cluster, ns, "ssa", 1), 90, "the pod ready")
    time.sleep(3)  # the rollout's last status writes
    # cpu 0.5 (stored as 500m): no patch loop. Over 20 s of owned-object events (the pod turning ready,
    # controllers writing status) the Deployment's spec stays at one generation and no Event repeats.
    dep0 = cluster.kubectl_json("get", "deployment", "ssa", "-n", ns)
    applies0 = operator.metric("kvpilot_operator_applies_total", namespace=ns, kind="Deployment")
    events0 = len(
        cluster.kubectl_json("get", "events", "-n", ns, "--field-selector", "involvedObject.name=ssa")[
            "items"
        ]
    )
    cluster.kubectl("annotate", "infd/ssa", "-n", ns, "poke=1")  # an update event: one more apply, a no-op
    time.sleep(20)
    dep1 = cluster.kubectl_json("get", "deployment", "ssa", "-n", ns)
    events1 = len(
        cluster.kubectl_json("get", "events", "-n", ns, "--field-selector", "involvedObject.name=ssa")[
            "items"
        ]
    )
    applies1 = operator.metric("kvpilot_operator_applies_total", namespace=ns, kind="Deployment")
    assert dep1["metadata"]["generation"] == dep0["metadata"]["generation"]
    # nothing written at all
    assert dep1["metadata"]["resourceVersion"] == dep0["metadata"]["resourceVersion"]
    assert events1 == events0, cluster.kubectl("get", "events", "-n", ns).stdout
    # A loop re-applies within ~0.1 s of each event (100+ in 20 s); a few are the poke and this fleet's
    # owned-object events (pod and status writes). Counted in this namespace only: the shared operator's
    # other fleets apply too (counted all together, CI saw 4 and then 7 with nothing written here).
    assert applies1 - applies0 <= 6, f"{applies1 - applies0} applies in 20 s: a loop"
    assert dep1["metadata"]["annotations"]["team.example/owner"] == "ml"
    fields = cluster.kubectl_json("get", "deployment", "ssa", "-n", ns, "--show-managed-fields")["metadata"]
    managers = {m["manager"] for m in fields["managedFields"] if m["operation"] == "Apply"}
    assert managers == {"kvpilot-operator"}


def test_annotation_trigger_and_ttl(cluster: Cluster, ns: str) -> None:
    standin_fleet(cluster, ns, "ann")
    uid = infd(cluster, ns, "ann")["metadata"]["uid"]

    def owned_resets() -> list[dict]:
        items = cluster.kubectl_json("get", "pcr", "-n", ns)["items"]
        return [i for i in items if any(r["uid"] == uid for r in i["metadata"].get("ownerReferences") or [])]

    cluster.kubectl("annotate", "infd/ann", "-n", ns, "kvpilot.io/reset-prefix-cache=deploy-42")
    first = wait_for(lambda: owned_resets() or None, 30, "a PrefixCacheReset for the annotation")[0]
    assert first["spec"]["ttlSecondsAfterFinished"] == 86400  # annotation-made resets do not pile up
    r = wait_phase(cluster, ns, first["metadata"]["name"], 30)
    assert r["status"]["phase"] == "Succeeded" and r["status"]["succeeded"] == 2
    wait_for(
        lambda: (
            infd(cluster, ns, "ann")["status"].get("lastReset", {}).get("name") == first["metadata"]["name"]
        ),
        20,
        "status.lastReset",
    )
    time.sleep(4)  # a timer pass or two: the same token must not make a second reset
    assert len(owned_resets()) == 1
    cluster.kubectl(
        "annotate", "--overwrite", "infd/ann", "-n", ns, "kvpilot.io/reset-prefix-cache=deploy-43"
    )
    wait_for(lambda: len(owned_resets()) == 2, 30, "a second reset for a new token")

    apply_ns(cluster, ns, pcr("short", {"targetRef": {"name": "ann"}, "ttlSecondsAfterFinished": 2}))
    wait_phase(cluster, ns, "short", 30)
    wait_for(
        lambda: cluster.kubectl("get", "pcr", "short", "-n", ns, check=False).returncode != 0,
        30,
        "the finished reset deleted after its TTL",
    )


def test_daemonset_placement_on_two_nodes(cluster: Cluster, ns: str, base_image: str) -> None:
    # node-2 is the dev cluster's small node: stand-ins on the base image, tolerating its taint
    apply_ns(cluster, ns, fleet("local", {"placement": "DaemonSet", **standin_spec(on_base=base_image)}))
    wait_for(lambda: ready_replicas(cluster, ns, "local", 2), 90, "one ready daemon per node")
    nodes = sorted(p["spec"]["nodeName"] for p in fleet_pods(cluster, ns, "local"))
    assert nodes == ["node-1", "node-2"]
    assert cluster.kubectl("get", "deployment", "local", "-n", ns, check=False).returncode != 0
    apply_ns(cluster, ns, pcr("both", {"targetRef": {"name": "local"}}))
    r = wait_phase(cluster, ns, "both", 30)
    assert r["status"]["phase"] == "Succeeded"
    assert sorted(p["node"] for p in r["status"]["pods"]) == ["node-1", "node-2"]


def test_operator_identity_is_least_privilege(cluster: Cluster, operator_kubeconfig) -> None:
    sa = f"system:serviceaccount:{OP_NS}:kvpilot-operator"

    def can(*args: str) -> bool:
        return cluster.kubectl("auth", "can-i", "--as", sa, *args, check=False).stdout.strip() == "yes"

    assert (
        can("patch", "prefixcacheresets.kvpilot.io/status") and can("list", "pods") and can("watch", "pods")
    )
    assert can("get", "secrets") and not can("list", "secrets") and not can("watch", "secrets")
    assert not can("update", "secrets") and not can("get", "pods")
    # owner references that block deletion (kopf.adopt) need this under OwnerReferencesPermissionEnforcement
    assert can("update", "inferencedeployments.kvpilot.io", "--subresource=finalizers")
    assert not can("create", "events.events.k8s.io") and not can("update", "services")
    assert (
        not can("delete", "pods")
        and not can("create", "pods")
        and not can("delete", "inferencedeployments.kvpilot.io")
    )
    assert can("watch", "deployments.apps") and not can("update", "deployments.apps")
    assert (
        not can("patch", "nodes")
        and not can("create", "serviceaccounts", "--subresource=token")
        and not can("get", "roles.rbac.authorization.k8s.io")
        and not can("create", "roles.rbac.authorization.k8s.io")
    )
    # A fleet router's objects: made, read and removed with spec.router. Its rights come from a RoleBinding to
    # the routers' ClusterRole, which the operator may bind, and no other role; it does not hold them itself.
    assert can("delete", "services") and can("create", "rolebindings.rbac.authorization.k8s.io")
    assert not can("watch", "endpointslices.discovery.k8s.io")
    assert can("bind", f"clusterroles.rbac.authorization.k8s.io/{rbac.ROUTER_CLUSTER_ROLE}")
    assert not can("bind", "clusterroles.rbac.authorization.k8s.io/admin")
    assert not can("create", "clusterroles.rbac.authorization.k8s.io") and not can(
        "escalate", "clusterroles.rbac.authorization.k8s.io"
    )


CLI = """
import argparse, sys
from kvpilot.operator.cli import add_operator_parser, add_reset_parser
p = argparse.ArgumentParser(prog="kvpilot")
sub = p.add_subparsers(dest="command", required=True)
add_operator_parser(sub)
add_reset_parser(sub)
args = p.parse_args(sys.argv[1:])
sys.exit(args.handler(args))
"""


def test_reset_cli_waits_and_shows_every_pod(cluster: Cluster, ns: str) -> None:
    import subprocess
    import sys

    def kvpilot(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """`kvpilot ARGS --kubeconfig ...` (its operator and reset commands, as the CLI wires them)."""
        argv = [sys.executable, "-c", CLI, *args, "--kubeconfig", str(cluster.kubeconfig)]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)

    standin_fleet(cluster, ns, "cli")
    r = kvpilot("reset", "cli", "-n", ns, "--wait", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("prefixcachereset.kvpilot.io/cli-")
    assert lines[-1].startswith("Succeeded: AllPodsReset: 2/2 pods reset"), r.stdout
    for pod in fleet_pods(cluster, ns, "cli"):
        assert any(pod["metadata"]["name"] in x and "Succeeded" in x and "epoch 1" in x for x in lines), (
            r.stdout
        )
    # each pod's verdict (a stand-in serves no completions to verify with) and the Verified condition
    pod_lines = [x for x in lines if x.startswith("  ")]
    assert len(pod_lines) == 2 and all("verified unknown: GET /v1/models" in x for x in pod_lines), r.stdout
    assert lines[-2].startswith("Verified Unknown: NotVerified: 0/2 pods verified cold"), r.stdout
    off = kvpilot("reset", "cli", "-n", ns, "--wait", "--no-verify", "--no-reset-external", timeout=120)
    off_pods = [x for x in off.stdout.splitlines() if x.startswith("  ")]
    assert off.returncode == 0 and len(off_pods) == 2, off.stdout + off.stderr
    assert not any("verified" in x for x in off_pods), off.stdout
    assert off.stdout.splitlines()[-2].startswith("Verified Unknown: VerificationOff"), off.stdout
    name = off.stdout.splitlines()[0].split("/")[1].split()[0]
    spec = cluster.kubectl_json("get", "pcr", name, "-n", ns)["spec"]
    assert (spec["verify"], spec["resetExternal"]) == (False, False)
    bad = kvpilot("reset", "nope", "-n", ns)
    assert bad.returncode == 2 and f"InferenceDeployment {ns}/nope not found" in bad.stderr
    assert "Traceback" not in bad.stderr
    # --timeout: gives up waiting with its own exit code and message, no traceback
    slow = kvpilot("reset", "cli", "-n", ns, "--wait", "--timeout", "0")
    assert slow.returncode == 3 and "did not finish before --timeout" in slow.stderr, slow.stderr


def test_two_replicas_never_both_act(cluster: Cluster, ns: str, operator: OperatorProcess, tmp_path) -> None:
    """Peering: a second replica with a lower priority stays paused while the first lives, then takes over."""
    second = OperatorProcess(operator.kubeconfig, tmp_path / "second.log")
    second.start("--priority", "-100")
    # a replica of the same priority would pause with it: it says so at startup
    wait_for(
        lambda: any(
            p.get("priority") == -100
            for p in (
                cluster.kubectl_json("get", "clusterkopfpeering", "kvpilot").get("status") or {}
            ).values()
        ),
        30,
        "the second replica's peering entry",
    )
    third = OperatorProcess(operator.kubeconfig, tmp_path / "third.log")
    third.start("--priority", "-100")
    third.stop()
    assert "replicas of equal priority all pause" in third.log.read_text()
    try:
        ips = standin_pods(cluster, ns, "pair", 2)
        apply_ns(cluster, ns, pcr("once", {"selector": {"matchLabels": {"app": "pair"}}}))
        assert wait_phase(cluster, ns, "once", 30)["status"]["phase"] == "Succeeded"
        time.sleep(2)
        for ip in ips.values():
            assert http("GET", f"http://{ip}:8000/calls")["calls"] == 1
        assert second.metric("kvpilot_operator_reset_pod_requests_total") == 0  # it never called a pod
        operator.stop()  # a graceful exit leaves the peering: the second replica resumes
        apply_ns(cluster, ns, pcr("twice", {"selector": {"matchLabels": {"app": "pair"}}}))
        assert wait_phase(cluster, ns, "twice", 60)["status"]["phase"] == "Succeeded"
        for ip in ips.values():
            assert http("GET", f"http://{ip}:8000/calls")["calls"] == 2
        assert second.metric("kvpilot_operator_reset_pod_requests_total") == 2
    finally:
        second.stop()
        if operator.proc is None or operator.proc.poll() is not None:
            operator.start()


def test_vllm_and_sglang_fleets_by_selector(cluster: Cluster, ns: str, operator: OperatorProcess) -> None:
    """Fleets this operator does not run: vLLM's body-judged reply and SGLang's busy 400s, through the cluster;
    a vLLM with a CPU offload tier verified cold with resetExternal, and StillWarm without it (vLLM 57727)."""
    vllm_env = [{"name": "STANDIN_ENGINE", "value": "vllm"}, {"name": "STANDIN_OFFLOAD", "value": "1"}]
    apply_ns(cluster, ns, standin_deployment("vllm", 1, {"engine": "vllm"}, vllm_env))
    apply_ns(
        cluster,
        ns,
        standin_deployment(
            "sglang",
            1,
            {"engine": "sglang"},
            [{"name": "STANDIN_ENGINE", "value": "sglang"}, {"name": "STANDIN_BUSY_TIMES", "value": "2"}],
        ),
    )
    wait_deployment_ready(cluster, ns, "vllm", 1)
    wait_deployment_ready(cluster, ns, "sglang", 1)
    apply_ns(cluster, ns, pcr("v", {"selector": {"matchLabels": {"engine": "vllm"}}, "engine": "vllm"}))
    apply_ns(
        cluster,
        ns,
        pcr(
            "s",
            {
                "selector": {"matchLabels": {"engine": "sglang"}},
                "engine": "sglang",
                "retriesPerPod": 0,
                "timeoutSeconds": 30,
            },
        ),
    )
    v = wait_phase(cluster, ns, "v", 30)["status"]
    assert v["phase"] == "Succeeded" and v["pods"][0]["httpStatus"] == 200 and v["pods"][0]["attempts"] == 1
    assert (v["pods"][0]["verified"], v["pods"][0]["cleared"], v["verified"]) == (
        "cold",
        ["pool", "external"],
        "1/1",
    )
    # without reset_external the offload tier keeps serving the canary: the pod said success and Fails warm
    warm_before = operator.metric("kvpilot_operator_reset_verifications_total", namespace=ns, verdict="warm")
    kept = {"selector": {"matchLabels": {"engine": "vllm"}}, "engine": "vllm", "resetExternal": False}
    apply_ns(cluster, ns, pcr("v-kept", kept))
    k = wait_phase(cluster, ns, "v-kept", 30)["status"]
    pod = k["pods"][0]
    assert (k["phase"], pod["result"], pod["reason"], pod["verified"]) == (
        "Failed",
        "Failed",
        "StillWarm",
        "warm",
    )
    assert pod["cleared"] == ["pool"] and "served" in pod["message"] and k["verified"] == "0/1", k
    verified = next(c for c in k["conditions"] if c["type"] == "Verified")
    assert (verified["status"], verified["reason"]) == ("False", "StillWarm") and pod["name"] in verified[
        "message"
    ]
    assert (
        operator.metric("kvpilot_operator_reset_verifications_total", namespace=ns, verdict="warm")
        == warm_before + 1
    )
    s = wait_phase(cluster, ns, "s", 40)["status"]
    # two busy 400s are retried although retriesPerPod is 0; the third call flushes
    assert (
        s["phase"] == "Succeeded"
        and s["pods"][0]["attempts"] == 3
        and "SGLang reported the cache flushed" in s["pods"][0]["message"]
    )


def test_missing_target_fails_with_a_reason(cluster: Cluster, ns: str) -> None:
    """With waitForTarget, a target that does not exist is waited for until timeoutSeconds, then the reset
    fails with a reason; one that appears meanwhile is reset. `kubectl wait` for either condition returns.
    (Without waitForTarget it fails at once: test_operator_reset_ux.py.)"""
    t0 = time.monotonic()
    apply_ns(
        cluster,
        ns,
        pcr("ghost", {"targetRef": {"name": "nowhere"}, "timeoutSeconds": 4, "waitForTarget": True}),
    )
    r = cluster.kubectl("wait", "--for=condition=Failed", "pcr/ghost", "-n", ns, "--timeout=30s", check=False)
    assert r.returncode == 0, r.stderr
    st = cluster.kubectl_json("get", "pcr", "ghost", "-n", ns)["status"]
    cond = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert st["phase"] == "Failed" and cond["reason"] == "TargetNotFound" and "nowhere" in cond["message"]
    assert 3.5 < time.monotonic() - t0 < 20
    # created before its fleet: waited for, then reset
    apply_ns(
        cluster,
        ns,
        pcr("early", {"targetRef": {"name": "late"}, "timeoutSeconds": 90, "waitForTarget": True}),
    )
    time.sleep(2)
    apply_ns(cluster, ns, fleet("late", {"replicas": 1, **standin_spec()}))
    r = cluster.kubectl(
        "wait", "--for=condition=Complete", "pcr/early", "-n", ns, "--timeout=100s", check=False
    )
    assert r.returncode == 0, cluster.kubectl("get", "pcr", "early", "-n", ns, "-o", "yaml").stdout


def test_every_reset_ends_no_targets_and_refused_selectors(cluster: Cluster, ns: str) -> None:
    apply_ns(cluster, ns, pcr("nothing", {"selector": {"matchLabels": {"app": "none"}}}))
    apply_ns(cluster, ns, pcr("fine", {"selector": {"matchLabels": {"app": "none"}}, "allowNoTargets": True}))
    # a label value the API server refuses (the CRD lets any string through): Failed at once, not retried forever
    apply_ns(cluster, ns, pcr("badsel", {"selector": {"matchLabels": {"app": "not a valid value!"}}}))
    for name, phase, reason in (
        ("nothing", "Failed", "NoTargets"),
        ("fine", "Succeeded", "NoTargets"),
        ("badsel", "Failed", "InvalidRequest"),
    ):
        st = wait_phase(cluster, ns, name, 30)["status"]
        cond = next(c for c in st["conditions"] if c["status"] == "True")
        assert (st["phase"], cond["reason"]) == (phase, reason), st


def test_admin_tokens_go_only_where_their_owner_sent_them(
    cluster: Cluster, ns: str, operator: OperatorProcess
) -> None:
    import base64

    # Secure by default: a fleet without adminTokenSecretRef gets a generated token that its daemons require.
    standin_fleet(cluster, ns, "sec")
    secret = cluster.kubectl_json("get", "secret", "sec-admin-token", "-n", ns)
    assert secret["metadata"]["ownerReferences"][0]["uid"] == infd(cluster, ns, "sec")["metadata"]["uid"]
    assert len(base64.b64decode(secret["data"]["token"])) >= 32
    fleet_ips = {p["metadata"]["name"]: p["status"]["podIP"] for p in fleet_pods(cluster, ns, "sec")}
    with pytest.raises(urllib.error.HTTPError) as e:
        http("POST", f"http://{next(iter(fleet_ips.values()))}:8000/reset_prefix_cache")
    assert e.value.code == 401
    assert (
        "sec-admin-token" not in operator.log.read_text()
        or secret["data"]["token"] not in operator.log.read_text()
    )

    # Listening pods that must never see someone else's token: one wearing the fleet's labels but run by
    # something else, one that a PrefixCacheReset selects while naming another team's Secret.
    cluster.kubectl("create", "configmap", "owner", "-n", ns)
    cm_uid = cluster.kubectl_json("get", "configmap", "owner", "-n", ns)["metadata"]["uid"]
    apply_ns(
        cluster,
        ns,
        standin_pod(
            "rogue",
            {"kvpilot.io/inference-deployment": "sec"},
            owner={
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "name": "owner",
                "uid": cm_uid,
                "controller": True,
            },
        ),
    )
    apply_ns(
        cluster,
        ns,
        standin_pod(
            "listener", {"role": "listener"}, [{"name": "KVPILOT_ADMIN_TOKEN", "value": "listener-token"}]
        ),
    )
    cluster.kubectl("create", "secret", "generic", "other-team", "-n", ns, "--from-literal=token=theirs")
    for pod in ("rogue", "listener"):
        cluster.kubectl("wait", "--for=condition=Ready", f"pod/{pod}", "-n", ns, "--timeout=60s")
    ip = {
        p: cluster.kubectl_json("get", "pod", p, "-n", ns)["status"]["podIP"] for p in ("rogue", "listener")
    }

    def listener_reset(name: str, secret: str) -> dict:
        """A selector reset of the listener pod naming Secret `secret`: its status once finished."""
        spec = {"selector": {"matchLabels": {"role": "listener"}}, "adminTokenSecretRef": {"name": secret}}
        apply_ns(cluster, ns, pcr(name, spec))
        return wait_phase(cluster, ns, name, 30)["status"]

    st = listener_reset("steal", "other-team")
    cond = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert (
        st["phase"] == "Failed"
        and cond["reason"] == "AdminTokenNotAllowed"
        and "other-team" in cond["message"]
    )

    apply_ns(cluster, ns, pcr("fleet", {"targetRef": {"name": "sec"}}))
    st = wait_phase(cluster, ns, "fleet", 30)["status"]
    assert st["phase"] == "Succeeded" and (st["succeeded"], st["skipped"]) == (2, 1), st
    rogue = pods_by_name({"status": st})["rogue"]
    assert rogue["result"] == "Skipped" and "not run by the InferenceDeployment" in rogue["message"]
    for pod in ("rogue", "listener"):
        assert http("GET", f"http://{ip[pod]}:8000/calls")["calls"] == 0, f"{pod} was called"

    # A Secret its owner labelled for kvpilot admin use may go to the pods a selector reset picks.
    cluster.kubectl(
        "create", "secret", "generic", "listener-admin", "-n", ns, "--from-literal=token=listener-token"
    )
    cluster.kubectl("label", "secret", "listener-admin", "-n", ns, "kvpilot.io/admin-token=true")
    assert listener_reset("allowed", "listener-admin")["phase"] == "Succeeded"
    assert http("GET", f"http://{ip['listener']}:8000/calls")["resets"] == 1
