"""WeightUpdate against the dev cluster: an InferenceDeployment of 3 real `kvpilot serve` daemons (the
embedded model, few blocks), a checkpoint on a host path every pod reads, the operator under its RBAC.
Atomic ends Succeeded with every pod on the new version and digest; a pod that never answers its stage
leaves all 3 on the old version; a pod killed mid-commit is fenced (out of the Service's EndpointSlices)
and reported, then caught up to the fleet's weights and let back, also after a later restart; the API server
refuses bad specs; a Rolling update behind the fleet's router answers throughout, never going back to the
old weights once the router knows the new."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchkit import changed_checkpoint
from support.cluster import Cluster, host_folders, manifest, readable_by_pods
from support.operator import (
    OperatorProcess,
    apply_ns,
    container_pid,
    fleet,
    fleet_pods,
    infd,
    ready_replicas,
    service_endpoints,
)
from support.procs import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]
TOKEN = "wu-admin-token"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpilot.default_model import ensure_default_model

    # in a folder of its own, which the pods mount (real_fleet): the test renames the checkpoint in it
    folder = tmp_path_factory.mktemp("wu-ckpt")
    written = changed_checkpoint(ensure_default_model(), folder / "v")
    readable_by_pods(folder)
    return written


def real_fleet(
    cluster: Cluster,
    ns: str,
    replicas: int,
    router: bool = False,
    mounts: tuple[Path, ...] = (),
    **engine: object,
) -> dict[str, str]:
    """`replicas` ready daemons of InferenceDeployment llm (the embedded model; `engine` over the small
    defaults), with its fleet router if `router`; pod name -> IP."""
    cluster.kubectl("create", "secret", "generic", "admin", "-n", ns, f"--from-literal=token={TOKEN}")
    # its owner's consent: only a labelled (or the fleet's own) Secret is mounted into a fleet's pods
    cluster.kubectl("label", "secret", "admin", "-n", ns, "kvpilot.io/admin-token=true")
    spec = {
        "replicas": replicas,
        "adminTokenSecretRef": {"name": "admin"},
        "engine": {"kvCacheBlocks": 64, "maxNumSeqs": 2, "maxModelLen": 256, "dtype": "bfloat16", **engine},
        **host_folders(*mounts),
        **({"router": {"enabled": True, "policy": "round-robin"}} if router else {}),
    }
    apply_ns(cluster, ns, fleet("llm", spec))
    wait_for(
        lambda: ready_replicas(cluster, ns, "llm", replicas), 300, f"{replicas} ready daemons", interval=1
    )
    return {p["metadata"]["name"]: p["status"]["podIP"] for p in fleet_pods(cluster, ns, "llm")}


@pytest.fixture
def llm(cluster: Cluster, ns: str, operator: OperatorProcess, checkpoint: Path) -> Iterator[dict[str, str]]:
    """3 ready daemons of InferenceDeployment llm, `checkpoint`'s folder mounted; pod name -> IP."""
    yield real_fleet(cluster, ns, 3, mounts=(checkpoint.parent,))


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


def llm_update(checkpoint: Path, version: str, **extra: object) -> dict:
    """A WeightUpdate spec of fleet llm to `checkpoint` as `version`."""
    return {"targetRef": {"name": "llm"}, "modelPath": str(checkpoint), "version": version, **extra}


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
    pid = container_pid(cluster, ns, frozen)
    os.kill(pid, signal.SIGSTOP)
    try:
        apply_ns(cluster, ns, wu("to-v3", llm_update(checkpoint, "v3", timeoutSeconds=40)))
        st = wait_done(cluster, ns, "to-v3", 120)["status"]
    finally:
        os.kill(pid, signal.SIGCONT)
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
    spec = llm_update(checkpoint, "v4", strategy="Rolling", maxUnavailable=2)
    apply_ns(cluster, ns, wu("rolling", spec))
    st = wait_done(cluster, ns, "rolling", 300)["status"]
    assert st["phase"] == "Succeeded" and st["progress"] == "3/3", st
    assert {_get(ip)["weight_version"] for ip in llm.values()} == {"v4"}
    assert infd(cluster, ns, "llm")["status"]["weightVersions"] == {"v4": 3}  # v2's count is gone


def test_bad_specs_are_refused(cluster: Cluster, ns: str, operator: OperatorProcess) -> None:
    good = {"targetRef": {"name": "llm"}, "modelPath": "/ckpt", "version": "v2"}
    adapter_only = {"targetRef": {"name": "llm"}, "adapter": {"name": "sql", "path": "/a"}, "version": "v2"}
    bad = [
        ({**good, "modelPath": "relative/dir"}, "absolute path"),
        ({**good, "version": "mixed"}, "not 'mixed'"),
        ({**good, "version": "initial"}, "'initial'"),  # the daemons' name for unnamed weights
        ({**good, "strategy": "Sideways"}, "Unsupported value"),
        ({**good, "maxUnavailable": 2}, "maxUnavailable is for the Rolling strategy"),
        ({k: v for k, v in good.items() if k != "version"}, "version: Required value"),
        ({**good, "adapter": {"name": "sql", "path": "/a"}}, "exactly one of modelPath"),
        ({"targetRef": {"name": "llm"}, "version": "v2"}, "exactly one of modelPath"),
        ({**adapter_only, "strategy": "Rolling"}, "an adapter update is Atomic"),
        (
            {**adapter_only, "adapter": {"name": "sql", "path": "rel"}},
            "adapter.path must be an absolute path",
        ),
        # A name goes into the daemons' logs and metrics labels: no forged log line.
        (
            {**adapter_only, "adapter": {"name": "sql\nforged", "path": "/a"}},
            "adapter.name in body should match",
        ),
    ]
    for i, (spec, why) in enumerate(bad):
        obj = wu(f"bad-{i}", spec)
        obj["metadata"]["namespace"] = ns
        import yaml

        r = cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj), check=False)
        assert r.returncode != 0 and why in r.stderr, (spec, r.stderr)


def test_an_adapter_update_reaches_every_pod_or_none(
    cluster: Cluster, ns: str, operator: OperatorProcess, lora_adapters: dict[str, Path]
) -> None:
    """spec.adapter: the fleet's LoRA adapter `sql` to new files on both pods, its cache cold afterwards and
    the base model's warm; then a path one pod cannot load leaves both on those files."""
    import json
    import urllib.request

    first, second = lora_adapters["every-layer"], lora_adapters["attention-only"]
    lora = {"modules": [{"name": "sql", "path": str(first)}]}
    pods = real_fleet(cluster, ns, 2, mounts=(first.parent,), lora=lora)

    def served(ip: str) -> str:
        with urllib.request.urlopen(f"http://{ip}:8000/health", timeout=60) as r:
            return json.loads(r.read())["lora_adapters"]["sql"]

    def cached(ip: str, model: str | None) -> int:
        body = {
            "prompt": "A prompt long enough to fill two blocks of the cache, or so. " * 6,
            "max_tokens": 1,
        }
        req = urllib.request.Request(
            f"http://{ip}:8000/v1/completions",
            json.dumps(body | ({"model": model} if model else {})).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["usage"]["prompt_tokens_details"]["cached_tokens"]

    old = {served(ip) for ip in pods.values()}
    assert len(old) == 1
    for ip in pods.values():
        for model in ("sql", None, "sql", None):
            cached(ip, model)
    spec = {"targetRef": {"name": "llm"}, "adapter": {"name": "sql", "path": str(second)}, "version": "sql-2"}
    apply_ns(cluster, ns, wu("sql-2", spec))
    st = wait_done(cluster, ns, "sql-2", 120)["status"]
    assert st["phase"] == "Succeeded" and st["succeeded"] == 2, st
    new = {served(ip) for ip in pods.values()}
    assert len(new) == 1 and new != old and st["digest"] in new, (st, new)
    for ip in pods.values():  # the new weights are a new identity: nothing the old ones computed is served
        assert cached(ip, "sql") == 0 and cached(ip, None) > 0

    spec = {**spec, "adapter": {"name": "sql", "path": "/no/such/adapter"}, "version": "sql-3"}
    apply_ns(cluster, ns, wu("sql-3", spec))
    st = wait_done(cluster, ns, "sql-3", 120)["status"]
    assert st["phase"] == "Failed" and "no pod changed sql" in st["conditions"][-1]["message"], st
    assert {served(ip) for ip in pods.values()} == new


def test_a_missing_target_fails_at_once(cluster: Cluster, ns: str, operator: OperatorProcess) -> None:
    apply_ns(cluster, ns, wu("lost", {"targetRef": {"name": "nope"}, "modelPath": "/ckpt", "version": "v2"}))
    st = wait_done(cluster, ns, "lost", 60)["status"]
    cond = {c["type"]: c for c in st["conditions"]}["Failed"]
    assert (st["phase"], cond["reason"]) == ("Failed", "TargetNotFound")
    assert cond["message"] == f"InferenceDeployment {ns}/nope not found"
    assert st["target"] == "InferenceDeployment/nope" and st["version"] == "v2"


def _serving_label(cluster: Cluster, ns: str, pod: str) -> str | None:
    return cluster.kubectl_json("get", "pod", pod, "-n", ns)["metadata"]["labels"].get("kvpilot.io/serving")


def _events(cluster: Cluster, ns: str, reason: str) -> list[str]:
    evs = cluster.kubectl_json("get", "events", "-n", ns, "--field-selector", f"reason={reason}")["items"]
    return [e["message"] for e in evs]


def _stream(ip: str, out: list[str]) -> None:
    """A long greedy stream on the pod, so that its pause (mode wait) drains it: the commit waits on this
    pod while the test kills it. `out`: "token" per chunk, its finish_reason, or the error that ended it."""
    import json
    import urllib.request

    body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(
        f"http://{ip}:8000/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    reason = json.loads(line[6:])["choices"][0].get("finish_reason")
                    out.append(reason or "token")
    except Exception as exc:  # noqa: BLE001 - the kill ends it: that is the point
        out.append(f"error: {exc}")


def _committing(cluster: Cluster, ns: str, update: str, streams: dict[str, list[str]]) -> None:
    """Wait until the update commits while each pod of `streams` drains its stream (pause mode wait)."""

    def committing() -> bool:
        phase = (cluster.kubectl_json("get", "wu", update, "-n", ns).get("status") or {}).get("phase")
        assert phase not in ("Succeeded", "Failed", "Degraded"), f"ended {phase} early; streams {streams}"
        return phase == "Committing"

    wait_for(committing, 120, f"{update} to commit", interval=0.2)


def _start_streams(pods: dict[str, str], names: list[str]) -> dict[str, list[str]]:
    import threading

    streams: dict[str, list[str]] = {n: [] for n in names}
    for n in names:
        threading.Thread(target=_stream, args=(pods[n], streams[n]), daemon=True).start()
    wait_for(lambda: all("token" in v for v in streams.values()), 120, f"the streams to start: {streams}")
    return streams


def _kill(cluster: Cluster, ns: str, pod: str) -> None:
    os.kill(container_pid(cluster, ns, pod), signal.SIGKILL)


def test_a_pod_killed_mid_commit_is_fenced_then_caught_up(
    cluster: Cluster, ns: str, operator: OperatorProcess, checkpoint: Path
) -> None:
    pods = real_fleet(cluster, ns, 2, mounts=(checkpoint.parent,), kvCacheBlocks=80, maxModelLen=1100)
    victim, other = sorted(pods)
    assert {_serving_label(cluster, ns, p) for p in pods} == {"true"}
    all_in = dict.fromkeys(pods, True)  # the EndpointSlice controller follows the pods' readiness a bit later
    wait_for(lambda: service_endpoints(cluster, ns, "llm") == all_in, 60, "both pods in the Service")

    # Both killed mid-commit: no pod changed weights, so none is fenced and the fleet records no weights
    # (fencing them would take the whole fleet out of its Service).
    streams = _start_streams(pods, [victim, other])
    apply_ns(cluster, ns, wu("to-v1", llm_update(checkpoint, "v1", timeoutSeconds=120)))
    _committing(cluster, ns, "to-v1", streams)
    for name in pods:
        _kill(cluster, ns, name)
    st = wait_done(cluster, ns, "to-v1", 180)["status"]
    cond = {c["type"]: c for c in st["conditions"]}["Degraded"]
    assert cond["reason"] == "CommitFailed" and "no pod serves v1" in cond["message"], cond
    assert {_serving_label(cluster, ns, p) for p in pods} == {"true"}
    assert "weights" not in infd(cluster, ns, "llm")["status"]

    def restarted() -> bool:
        for name in pods:
            c = cluster.kubectl_json("get", "pod", name, "-n", ns)["status"]["containerStatuses"][0]
            if not (c["restartCount"] >= 1 and c["ready"]):
                return False
        return True

    wait_for(restarted, 180, "both restarted and ready", interval=1)

    # One killed mid-commit: it is fenced, the other serves v2.
    out = _start_streams(pods, [victim])[victim]
    apply_ns(cluster, ns, wu("to-v2", llm_update(checkpoint, "v2", timeoutSeconds=120)))
    _committing(cluster, ns, "to-v2", {victim: out})
    # Staged on both: from here on the checkpoint is not read. Hidden, the first catch-ups fail (404), so
    # the fenced pod is seen fenced; the victim is killed while its pause drains the stream.
    hidden = checkpoint.with_name(checkpoint.name + "-hidden")
    checkpoint.rename(hidden)
    try:
        _kill(cluster, ns, victim)
        st = wait_done(cluster, ns, "to-v2", 180)["status"]
        assert not {"length", "stop"} & set(out), out[-3:]  # cut, never finished: killed mid-commit
        assert st["phase"] == "Degraded", st
        cond = {c["type"]: c for c in st["conditions"]}["Degraded"]
        assert cond["reason"] == "CommitFailed" and victim in cond["message"] and other not in cond["message"]
        results = {p["name"]: p for p in st["pods"]}
        assert (results[victim]["result"], results[other]["result"]) == ("Fenced", "Succeeded"), st["pods"]
        digest = results[other]["stagedDigest"]
        # the fleet's weights, recorded: what the catch-up brings the victim to
        weights = infd(cluster, ns, "llm")["status"]["weights"]
        assert weights == {"version": "v2", "modelPath": str(checkpoint), "digest": digest, "model": ""}
        # Fenced through the API server: labelled not serving, out of the Service's EndpointSlices (so out
        # of the router's), while its restarted container serves again on its --model.
        assert _serving_label(cluster, ns, victim) == "false"
        wait_for(
            lambda: set(service_endpoints(cluster, ns, "llm")) == {other}, 60, "the victim out of the Service"
        )
        wait_for(lambda: _events(cluster, ns, "CatchUpFailed"), 120, "a catch-up that fails (no checkpoint)")
        assert operator.metric("kvpilot_operator_fenced_pods", namespace=ns, deployment="llm") == 1
        assert _serving_label(cluster, ns, victim) == "false" and set(
            service_endpoints(cluster, ns, "llm")
        ) == {other}
    finally:
        hidden.rename(checkpoint)
    # The checkpoint back: the next catch-up (after its back-off) stages and commits v2 on the victim alone
    # and lets it back into the Service.
    wait_for(lambda: _serving_label(cluster, ns, victim) == "true", 180, "the victim caught up, un-fenced")
    info = _get(pods[victim])
    assert (info["weight_version"], info["digest"]) == ("v2", digest)
    wait_for(lambda: service_endpoints(cluster, ns, "llm") == all_in, 60, "both in the Service")
    assert any(victim in m and "caught up to v2" in m for m in _events(cluster, ns, "PodUnfenced"))
    wait_for(
        lambda: operator.metric("kvpilot_operator_fenced_pods", namespace=ns, deployment="llm") == 0,
        30,
        "0 fenced",
    )

    # A restart with no update running (its container comes back on --model): fenced, caught up, let back.
    fenced_before = len(_events(cluster, ns, "PodFenced"))
    _kill(cluster, ns, victim)
    wait_for(lambda: len(_events(cluster, ns, "PodFenced")) > fenced_before, 120, "the restarted pod fenced")

    def back() -> bool:
        try:
            on_v2 = _get(pods[victim])["weight_version"] == "v2"
        except OSError:
            return False
        return on_v2 and _serving_label(cluster, ns, victim) == "true"

    wait_for(back, 180, "the restarted pod caught up and un-fenced")
    assert _get(pods[other])["weight_version"] == "v2"

    # Weights recorded over another model than spec.model (as after a change of spec.model): dropped at the
    # next look (a restart), not forced on the pod, which comes back on its --model and stays in the Service.
    other_model = '{"status":{"weights":{"model":"/models/before"}}}'
    cluster.kubectl(
        "patch", "infd", "llm", "-n", ns, "--subresource=status", "--type=merge", "-p", other_model
    )
    _kill(cluster, ns, victim)
    wait_for(lambda: "weights" not in infd(cluster, ns, "llm")["status"], 120, "the record dropped")
    assert _events(cluster, ns, "WeightsForgotten") and _serving_label(cluster, ns, victim) == "true"


# ---- Rolling behind the fleet's router ----------------------------------------------------------------
def _router_get(url: str) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def _router_complete(router: str) -> tuple[int, str | None]:
    """(status, system_fingerprint) of a 2-token completion through the router."""
    import json
    import urllib.error
    import urllib.request

    body = {"model": "SmolLM2-135M-Instruct", "prompt": "One, two, three,", "max_tokens": 2, "temperature": 0}
    req = urllib.request.Request(
        f"{router}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()).get("system_fingerprint")
    except urllib.error.HTTPError as exc:
        return exc.code, None


def test_rolling_behind_the_router_answers_throughout_each_from_one_version(
    cluster: Cluster, ns: str, operator: OperatorProcess, checkpoint: Path
) -> None:
    """A Rolling update of 3 pods, one at a time, while a client keeps asking through the fleet's router:
    every answer is a 200 from the old or the new weights, and once the router knows a pod on the new
    ones (its /health says so before the request is sent), every answer comes from them."""
    import threading

    real_fleet(cluster, ns, 3, router=True, mounts=(checkpoint.parent,))
    cluster.kubectl("wait", "--for=condition=Ready", "infd/llm", "-n", ns, "--timeout=300s")
    slices = cluster.kubectl_json(
        "get", "endpointslices", "-n", ns, "-l", "kubernetes.io/service-name=llm-router"
    )
    (ep,) = [
        e
        for s in slices["items"]
        for e in s.get("endpoints") or []
        if (e.get("conditions") or {}).get("ready")
    ]
    router = f"http://{ep['addresses'][0]}:8080"
    seen: list[tuple[bool, int, str | None]] = []  # (the router knew a pod on r2, status, fingerprint)
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            pods = _router_get(f"{router}/health")["pods"]
            knew = any(p["ready"] and p["weight_versions"] == ["r2"] for p in pods)
            seen.append((knew, *_router_complete(router)))

    t = threading.Thread(target=client, daemon=True)
    t.start()
    try:
        wait_for(lambda: len(seen) >= 2, 120, "answers through the router before the update")
        apply_ns(cluster, ns, wu("roll", llm_update(checkpoint, "r2", strategy="Rolling", maxUnavailable=1)))
        st = wait_done(cluster, ns, "roll", 420)["status"]
        n = len(seen)
        wait_for(lambda: len(seen) >= n + 3, 120, "answers after the update")
    finally:
        stop.set()
        t.join(180)
    assert st["phase"] == "Succeeded" and st["progress"] == "3/3", st
    assert [s for s in seen if s[1] != 200] == [], seen
    old = seen[0][2]
    assert old != "r2" and {f for _, _, f in seen} == {old, "r2"}, seen
    assert [s for s in seen if s[0] and s[2] != "r2"] == [], seen  # never back to the old weights
    assert seen[-1][2] == "r2"
