"""A real Kubernetes cluster on one machine for tests and demos: dev tooling, imported as `devcluster` from
hack/lib (never shipped in the kvpilot package or its image).

- binaries: builds/locates etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the kubelet,
  kube-proxy and crictl
- controlplane: starts the control plane on loopback, waits for readiness, writes kubeconfigs
- kubeletnode: nodes of the real kubelet, containerd and runc running the project's image (registry: the
  loopback registry they pull it from)
- serviceproxy, apiproxy: kube-proxy, and the forwarder that puts the API server behind the `kubernetes`
  Service's ClusterIP
- cli: `hack/cluster/devcluster.py up|down|run`

See docs/cluster.md.
"""

from .controlplane import ControlPlane, User

__all__ = ["ControlPlane", "User"]
