"""The node agent: a small local kubelet for the dev cluster.

It registers Nodes and renews their Leases, binds pending pods when no
scheduler runs, starts a PodRunner for every pod bound to one of its nodes,
copies each runner's status onto the pod, and on deletion stops the pod within
its grace period, removes its network namespace and finalizes the deletion.

It polls the pod list twice a second rather than watching: on a dev cluster
that is cheap, and a poll loop cannot miss an event or hang on a dead watch.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client

from . import apiproxy, pki
from .apiproxy import ApiProxy
from .binding import Binder
from .kubeapi import MERGE, json_of, micro_now, now
from .logserver import LogServer
from .netns import Network
from .podrunner import PodRunner

log = logging.getLogger("devcluster.agent")
KUBE_VERSION = "v1.37.2"
LEASE_SECONDS = 40


@dataclass
class NodeSpec:
    """One Node this agent pretends to be."""

    name: str
    cpu: str = "16"
    memory: str = "64Gi"
    pods: str = "110"
    gpus: int = 1
    labels: dict[str, str] = field(default_factory=dict)

    def capacity(self) -> dict[str, str]:
        cap = {"cpu": self.cpu, "memory": self.memory, "pods": self.pods, "ephemeral-storage": "100Gi"}
        cap["nvidia.com/gpu"] = str(self.gpus)
        return cap


class NodeAgent:
    def __init__(
        self,
        api: client.ApiClient,
        network: Network,
        workdir: Path,
        nodes: list[NodeSpec],
        bind_pods: bool | None = None,
    ) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.coord = client.CoordinationV1Api(api)
        self.network = network
        self.workdir = workdir
        self.nodes = {n.name: n for n in nodes}
        self.node_index = {n.name: i + 1 for i, n in enumerate(nodes)}
        self.binder = Binder(self.core, self.coord, self.nodes, bind_pods)
        self.runners: dict[str, PodRunner] = {}  # by pod uid
        self.stopping: set[str] = set()
        self.sent: dict[str, dict] = {}  # last status patched, by pod uid
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.logs: LogServer | None = None
        self.api_proxy: ApiProxy | None = None
        self.api_env: dict[str, str] = {}  # what every pod gets to find the apiserver
        self._since = now()  # lastTransitionTime of the node conditions

    # ---- lifecycle -------------------------------------------------------
    def start(self) -> None:
        self.network.setup()
        self._start_log_server()
        self._start_api_access()
        for spec in self.nodes.values():
            self._register(spec)
        for target, name in ((self._heartbeat_loop, "heartbeat"), (self._pod_loop, "pods")):
            t = threading.Thread(target=target, name=f"agent-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, grace: float = 2.0) -> None:
        """Stop every pod (short grace), the loops, and remove all pod networking."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        stoppers = [threading.Thread(target=r.stop, args=(grace,)) for r in self.runners.values()]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        self.runners.clear()
        if self.logs is not None:
            self.logs.stop()
        if self.api_proxy is not None:
            self.api_proxy.stop()
        self.network.teardown()

    def wait(self) -> None:
        self._stop.wait()

    def _start_log_server(self) -> None:
        ca = self.api.configuration.ssl_ca_cert  # the cluster CA, which signed the apiserver's client cert
        if not ca:
            log.warning("no cluster CA in the kubeconfig: kubectl logs will not work")
            return
        crt, key = pki.self_signed(self.workdir / "agent-pki", "node-agent", self.network.host_ip)
        self.logs = LogServer(self.network.host_ip, crt, key, ca, self._log_file, self._pod_running)
        self.logs.start()

    def _start_api_access(self) -> None:
        # Pods in network namespaces reach the loopback apiserver through the bridge, as a
        # Service's port 443; loopback-mode pods share the host's network and use it directly.
        target = apiproxy.endpoint(self.api.configuration.host)
        if self.network.rootful:
            self.api_proxy = ApiProxy((self.network.host_ip, apiproxy.SERVICE_PORT), target)
            self.api_proxy.start()
            self.api_env = apiproxy.service_env(self.network.host_ip, apiproxy.SERVICE_PORT)
        else:
            self.api_env = apiproxy.service_env(*target)

    def _runner(self, ns: str, name: str) -> PodRunner | None:
        for r in list(self.runners.values()):
            if r.pod["metadata"]["namespace"] == ns and r.pod["metadata"]["name"] == name:
                return r
        return None

    def _log_file(self, ns: str, name: str, container: str) -> Path | None:
        r = self._runner(ns, name)
        names = (
            {c["name"] for c in r.pod["spec"]["containers"] + (r.pod["spec"].get("initContainers") or [])}
            if r
            else ()
        )
        return r.pod_dir / "logs" / f"{container}.log" if r and container in names else None

    def _pod_running(self, ns: str, name: str) -> bool:
        return self._runner(ns, name) is not None and not self._stop.is_set()

    # ---- nodes -----------------------------------------------------------
    def _register(self, spec: NodeSpec) -> None:
        labels = {
            "kubernetes.io/hostname": spec.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "kvpilot.dev/devcluster": "true",
            **spec.labels,
        }
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": spec.name, "labels": labels},
            "spec": {"podCIDR": self.network.node_cidr(self.node_index[spec.name])},
        }
        try:
            self.core.create_node(body, _preload_content=False)
        except client.ApiException as e:
            if e.status != 409:
                raise
            self.core.patch_node(spec.name, {"metadata": {"labels": labels}}, _preload_content=False)
        self._patch_node_status(spec)
        node = json_of(self.core.read_node(spec.name, _preload_content=False))
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": spec.name,
                # Owned by the Node, so deleting the Node removes its Lease.
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": spec.name, "uid": node["metadata"]["uid"]}
                ],
            },
            "spec": {
                "holderIdentity": spec.name,
                "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": micro_now(),
            },
        }
        try:
            self.coord.create_namespaced_lease("kube-node-lease", lease, _preload_content=False)
        except client.ApiException as e:
            if e.status != 409:
                raise
            self._renew(spec.name)

    def _patch_node_status(self, spec: NodeSpec) -> None:
        t = now()
        conds = [
            ("MemoryPressure", "False", "KubeletHasSufficientMemory"),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID"),
            ("Ready", "True", "KubeletReady"),
        ]
        status = {
            "capacity": spec.capacity(),
            "allocatable": spec.capacity(),
            "conditions": [
                {
                    "type": ty,
                    "status": st,
                    "reason": r,
                    "message": "kvpilot node agent",
                    "lastHeartbeatTime": t,
                    "lastTransitionTime": self._since,  # conditions never change
                }
                for ty, st, r in conds
            ],
            "addresses": [
                {"type": "InternalIP", "address": self.network.host_ip},
                {"type": "Hostname", "address": spec.name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.logs.port if self.logs else 0}},
            "nodeInfo": {
                "machineID": spec.name,
                "systemUUID": spec.name,
                "bootID": spec.name,
                "kernelVersion": "",
                "osImage": "kvpilot devcluster",
                "containerRuntimeVersion": "kvpilot://local",
                "kubeletVersion": KUBE_VERSION,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }
        self.core.patch_node_status(
            spec.name, {"status": status}, _preload_content=False, _content_type=MERGE
        )

    def _renew(self, name: str) -> None:
        body = {"spec": {"renewTime": micro_now(), "holderIdentity": name}}
        self.coord.patch_namespaced_lease(
            name, "kube-node-lease", body, _preload_content=False, _content_type=MERGE
        )

    def _heartbeat_loop(self) -> None:
        # Leases every 10s as the kubelet does; the Ready condition once a minute.
        last_status = time.monotonic()
        while not self._stop.wait(10):
            for spec in self.nodes.values():
                try:
                    self._renew(spec.name)
                    if time.monotonic() - last_status > 60:
                        self._patch_node_status(spec)
                except client.ApiException as e:
                    if e.status == 404:  # node deleted behind our back: register again
                        self._safe(self._register, spec)
                    else:
                        log.warning("heartbeat for %s failed: %s", spec.name, e.reason)
                except Exception as e:  # noqa: BLE001 - keep heart beating through API blips
                    log.warning("heartbeat for %s failed: %s", spec.name, e)
            if time.monotonic() - last_status > 60:
                last_status = time.monotonic()

    # ---- pods ------------------------------------------------------------
    def _pod_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception as e:  # noqa: BLE001 - an API blip must not kill the agent
                log.warning("pod sync failed: %s", e)
            self._stop.wait(0.5)

    def _sync(self) -> None:
        pods = json_of(self.core.list_pod_for_all_namespaces(_preload_content=False))["items"]
        seen = set()
        pending = []
        for pod in pods:
            uid, node = pod["metadata"]["uid"], pod["spec"].get("nodeName")
            seen.add(uid)
            if not node:
                if not pod["metadata"].get("deletionTimestamp"):
                    pending.append(pod)
            elif node in self.nodes:
                self._sync_pod(pod)
        if pending and self.binder.should_bind():
            self.binder.bind(pending, pods)
        for uid in list(self.runners):
            if uid not in seen and uid not in self.stopping:  # force-deleted: just stop it
                self._stop_pod(uid, None, 2.0)

    def _sync_pod(self, pod: dict) -> None:
        meta, uid = pod["metadata"], pod["metadata"]["uid"]
        if meta.get("deletionTimestamp"):
            if uid not in self.stopping:
                grace = float(meta.get("deletionGracePeriodSeconds") or 0)
                self._stop_pod(uid, pod, grace)
            return
        runner = self.runners.get(uid)
        if runner is None:
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                return
            node = pod["spec"]["nodeName"]
            runner = PodRunner(
                pod=pod,
                core=self.core,
                network=self.network,
                node_index=self.node_index[node],
                host_ip=self.network.host_ip,
                workdir=self.workdir,
                api_env=self.api_env,
            )
            self.runners[uid] = runner
            log.info("starting pod %s on %s", runner.key, node)
            runner.start()
        self._report(pod, runner)

    def _report(self, pod: dict, runner: PodRunner) -> None:
        status = runner.status()
        if not status:
            return  # not computed yet
        # Conditions keep their lastTransitionTime while unchanged: the ReplicaSet
        # controller measures minReadySeconds from the Ready transition.
        old = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
        conds = [c for c in old.values() if c["type"] == "PodScheduled"]
        for c in status["conditions"]:
            prev = old.get(c["type"])
            same = prev is not None and prev.get("status") == c["status"]
            c["lastTransitionTime"] = prev.get("lastTransitionTime") if same else now()
            c["lastProbeTime"] = None
            conds.append(c)
        gates_ok, why = readiness_gates(pod, old)
        for c in conds:  # Ready needs the containers ready AND every readiness gate's condition True
            if c["type"] == "Ready" and c["status"] == "True" and not gates_ok:
                c["status"], c["reason"], c["message"] = "False", "ReadinessGatesNotReady", why
                prev = old.get("Ready") or {}
                same = prev.get("status") == "False"
                c["lastTransitionTime"] = prev.get("lastTransitionTime") if same else now()
            c.setdefault("reason", None)  # null: a strategic merge removes what an earlier patch set
            c.setdefault("message", None)
        status["conditions"] = conds
        key = json.dumps({**status, "conditions": [(c["type"], c["status"]) for c in conds]}, sort_keys=True)
        uid = pod["metadata"]["uid"]
        if self.sent.get(uid) == key:
            return
        try:
            self.core.patch_namespaced_pod_status(
                pod["metadata"]["name"],
                pod["metadata"]["namespace"],
                {"status": status},
                _preload_content=False,
                # strategic merge, as the kubelet's status manager patches: conditions merge by type, so
                # a condition the agent does not own (a readiness gate's, set by a controller) is kept
                _content_type=STRATEGIC,
            )
            self.sent[uid] = key
        except client.ApiException as e:
            if e.status != 404:
                log.warning("status update for %s failed: %s", runner.key, e.reason)

    def _stop_pod(self, uid: str, pod: dict | None, grace: float) -> None:
        """Stop in a thread (grace periods must not block other pods), then finalize."""
        self.stopping.add(uid)

        def work() -> None:
            runner = self.runners.get(uid)
            try:
                if runner is not None:
                    log.info("stopping pod %s (grace %ss)", runner.key, grace)
                    runner.stop(grace)
                if pod is not None:
                    meta = pod["metadata"]
                    # grace 0 + uid precondition: the kubelet's final delete. The grace goes in the
                    # body too: this client sends the body's unset fields as null, overriding the query.
                    self.core.delete_namespaced_pod(
                        meta["name"],
                        meta["namespace"],
                        grace_period_seconds=0,
                        body={"gracePeriodSeconds": 0, "preconditions": {"uid": uid}},
                        _preload_content=False,
                    )
            except client.ApiException as e:
                if e.status != 404:  # 404: already gone
                    log.warning("finalizing pod %s failed: %s %s", uid, e.status, e.reason)
            except Exception:
                log.exception("finalizing pod %s failed", uid)
            finally:
                self.runners.pop(uid, None)
                self.sent.pop(uid, None)
                self.stopping.discard(uid)

        threading.Thread(target=work, name=f"stop-{uid[:8]}", daemon=True).start()

    @staticmethod
    def _safe(fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            log.warning("%s failed: %s", getattr(fn, "__name__", fn), e)


STRATEGIC = "application/strategic-merge-patch+json"


def readiness_gates(pod: dict, conditions: dict[str, dict]) -> tuple[bool, str]:
    """Whether every readiness gate of the pod (spec.readinessGates) has its condition True, as the kubelet
    computes Ready (pkg/kubelet/status/generate.go): (True, "") or (False, its message for the first that
    is not)."""
    for gate in (pod.get("spec") or {}).get("readinessGates") or []:
        t = gate.get("conditionType", "")
        c = conditions.get(t)
        if c is None:
            return False, f'corresponding condition of pod readiness gate "{t}" does not exist.'
        if c.get("status") != "True":
            return False, f'the status of pod readiness gate "{t}" is not "True", but {c.get("status")}'
    return True, ""
