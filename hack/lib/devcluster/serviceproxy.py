"""Services on kubelet nodes (kubeletnode.py): the real kube-proxy, one for the host that every node shares,
and the API server within the pods' reach at the `kubernetes` Service, as on any cluster.

The API server listens on loopback alone, which pods cannot reach: a forwarder (apiproxy.py) listens on a
host address they do reach (a node's bridge address) and the `kubernetes` Service's EndpointSlice names it
(the API server's own endpoint reconciler is off: it would publish 127.0.0.1). kube-proxy then sends
10.96.0.1:443, the address the kubelet gives every pod in KUBERNETES_SERVICE_HOST, there; in-cluster clients
(the operator's kopf, `helm test` pods) verify it by the API server's certificate, which names 10.96.0.1.

kube-proxy masquerades all Service traffic (`--masquerade-all`): a pod calling a Service whose endpoint is a
pod on its own bridge gets the reply back through the host, not straight from the other pod's address.
Its iptables chains (KUBE-*) are removed with the nodes' (kubeletnode.KubeletNode.stop puts back the chains the
host had before).
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from . import procs
from .apiproxy import ApiProxy, endpoint
from .controlplane import ControlPlane
from .kubeletnode import lock_file, try_flock

log = logging.getLogger("devcluster.services")

SLICE_NAME = "kubernetes-devcluster"


@dataclass
class ServiceProxy:
    control_plane: ControlPlane
    workdir: Path
    listen_ip: str  # a host address every pod reaches: a node's bridge address
    cluster_cidr: str
    _proc: subprocess.Popen | None = field(default=None, init=False)
    _forwarder: ApiProxy | None = field(default=None, init=False)
    _lock: int | None = field(default=None, init=False)

    def start(self, timeout: float = 60) -> ServiceProxy:
        cp = self.control_plane
        # Two kube-proxies would each rewrite the host's KUBE-SERVICES chain with their own cluster's Services.
        self._lock = lock_file("kube-proxy")
        if not try_flock(self._lock, fcntl.LOCK_EX):
            os.close(self._lock)
            self._lock = None
            raise RuntimeError(
                "another cluster of kubelet nodes runs on this host (its kube-proxy owns the host's Service rules): "
                "stop it first (make cluster-down)"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        port = procs.free_port()
        self._forwarder = ApiProxy((self.listen_ip, port), endpoint(cp.url))
        self._forwarder.start()
        self._publish_endpoint(port)
        healthz = procs.free_port()
        argv = [
            str(cp.bin_dir / "kube-proxy"),
            f"--kubeconfig={cp.kubeconfig}",
            "--proxy-mode=iptables",
            f"--cluster-cidr={self.cluster_cidr}",
            "--masquerade-all",
            f"--healthz-bind-address=127.0.0.1:{healthz}",
            f"--metrics-bind-address=127.0.0.1:{procs.free_port()}",
            # Leave the host's conntrack table and timeouts alone.
            "--conntrack-max-per-core=0",
            "--conntrack-tcp-timeout-established=0",
            "--conntrack-tcp-timeout-close-wait=0",
            "--oom-score-adj=0",  # this sandbox may not lower it (as the kubelet's oomScoreAdj)
            "--iptables-localhost-nodeports=false",  # ... and route_localnet
            "--hostname-override=node-1",
            "--v=1",
        ]
        self._proc = procs.spawn(argv, log_path=self.workdir / "kube-proxy.log", env=procs.sbin_path())
        procs.wait_ready(
            self._proc, lambda: self._programmed(), timeout, "kube-proxy", self.workdir / "kube-proxy.log"
        )
        log.info("kube-proxy up; the API server at %s:%d for pods (Service kubernetes)", self.listen_ip, port)
        return self

    def stop(self) -> None:
        if self._proc is not None:
            procs.stop(self._proc, grace=5)
            self._proc = None
        if self._forwarder is not None:
            self._forwarder.stop()
            self._forwarder = None
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _publish_endpoint(self, port: int) -> None:
        api = config.new_client_from_config(config_file=str(self.control_plane.kubeconfig))
        body = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": SLICE_NAME,
                "namespace": "default",
                "labels": {
                    "kubernetes.io/service-name": "kubernetes",
                    "endpointslice.kubernetes.io/managed-by": "devcluster.kvpilot.io",
                },
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [self.listen_ip], "conditions": {"ready": True}}],
            "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
        }
        discovery = client.DiscoveryV1Api(api)
        try:
            discovery.create_namespaced_endpoint_slice("default", body)
        except ApiException as e:
            if e.status != 409:
                raise
            discovery.replace_namespaced_endpoint_slice(SLICE_NAME, "default", body)

    def _programmed(self) -> bool:
        """The kubernetes Service's rule is in iptables' nat table."""
        nat = subprocess.run(
            ["iptables", "-t", "nat", "-S", "KUBE-SERVICES"],
            capture_output=True,
            text=True,
            env=procs.sbin_path(),
        )
        return "default/kubernetes:https" in nat.stdout
