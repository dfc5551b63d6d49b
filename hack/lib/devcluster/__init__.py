"""A real Kubernetes control plane and a local node agent for tests and demos: dev tooling, imported
as `devcluster` from hack/lib (never shipped in the kvpilot package or its image).

- binaries: builds/locates etcd, kube-apiserver, kube-controller-manager
- controlplane: starts them on loopback, waits for readiness, writes kubeconfigs
- nodeagent: a small kubelet that runs pods as local processes (podrunner with probes,
  podspec, binding with scheduling, logserver for `kubectl logs`; kubeapi for raw API calls)
- netns: one network namespace per pod on a bridge (loopback addresses without root)
- apiproxy, mountns: what a kubelet gives pods to reach the API server (a forwarder and
  KUBERNETES_SERVICE_* env; the ServiceAccount folder, /etc/hosts and hostname per container)
- cli: `hack/cluster/devcluster.py up|down|run|agent`

See docs/cluster.md.
"""

from .controlplane import ControlPlane, User
from .nodeagent import NodeAgent, NodeSpec

__all__ = ["ControlPlane", "NodeAgent", "NodeSpec", "User"]
