"""A node run by the real kubelet, with containerd and runc from Debian (docs/cluster.md#real-nodes).

Each node has its own containerd (socket, state, content store) and its own kubelet (root dir, ports,
cgroup root, bridge and pod range), so two nodes on one machine never touch each other's pods. Pods get
their addresses from CNI (bridge + host-local + portmap) on a bridge that holds the node's own address, so
the host reaches every pod IP directly.

Images come from no registry outside: the images a test names (`make image`'s output, by its content-hash
tag) are pulled from buildah's store through a loopback registry (registry.py: the layers the node lacks)
into the node's containerd, and kept there between runs (a store per node slot under the cache; a slot is
held by one running node at a time); pods use `imagePullPolicy: IfNotPresent` or `Never`. The sandbox
("pause") image is a small static program built here.

What this host needs, and why each setting is there (all measured on the 2-core CI machine: cgroups v1,
no systemd, a disk under 15% free):
- kubelet `failCgroupV1: false` (else it exits on cgroups v1), `cgroupDriver: cgroupfs` (no systemd),
  `oomScoreAdj: 0` (this sandbox may not lower oom_score_adj), `evictionHard` on memory only and image GC
  off (the project's image must stay imported: the default image-fs threshold taints the node DiskPressure
  here, and a nearly full disk made the kubelet delete the pause image mid-run);
- containerd `restrict_oom_score_adj = true` (else runc fails: "can't get final child's PID from pipe") and
  `SystemdCgroup = false`.
The kubelet changes sysctls (kernel.panic, kernel.panic_on_oops, vm.overcommit_memory) and iptables
(the KUBE-FIREWALL, KUBE-KUBELET-CANARY and KUBE-IPTABLES-HINT chains) and makes /var/lib/kubelet/device-plugins and /var/log/pods
whatever its root dir: `stop()` puts back what it found.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from . import pki, procs, registry
from .controlplane import ControlPlane

log = logging.getLogger("devcluster.kubelet")

CACHE = Path(os.environ.get("KVPILOT_CACHE", Path.home() / ".cache" / "kvpilot")) / "nodes"
CNI_BIN_DIR = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
RUNTIME_PACKAGES = ("containerd", "runc", "containernetworking-plugins")
# Kubelet nodes take 10.252/16, a /24 each.
# The kubelet reports every 4 s (nodeStatusUpdateFrequency below): a node this long silent is down (the control
# plane's node-monitor-grace-period).
NODE_MONITOR_GRACE_S = 16
POD_NET_PREFIX = "10.252"
# The kubelet's (kernel/*, vm/*), the CNI bridge plugin's (forwarding, for a gateway) and kube-proxy's (it is
# asked to leave conntrack alone; kept in case it does not).
SYSCTLS = (
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "net/ipv4/ip_forward",
    "net/netfilter/nf_conntrack_tcp_timeout_established",
    "net/netfilter/nf_conntrack_tcp_timeout_close_wait",
)
IPTABLES_TABLES = ("filter", "nat", "mangle")
HOST_DIRS = (Path("/var/lib/kubelet"), Path("/var/log/pods"), Path("/var/log/containers"))
CGROUP_FS = Path("/sys/fs/cgroup")
# A run dir per slot (KubeletNode.run_dir), and the host-wide locks and saved host state: host-wide, like the
# bridges, cgroups and sysctls they guard (never under a user's cache folder).
RUN_ROOT = Path("/var/lib/kvpilot-nodes")
LOCKS = RUN_ROOT / "locks"
HOST_STATE = RUN_ROOT / "host-state.json"
MAX_SLOTS = 8  # kubelet nodes running at once on one machine
# A node that holds only small images (kubelet_nodes' `small_node`): a store of the project's image is some 10 GB
# of disk, too much for a second node on a test machine. Only pods that tolerate this taint run there.
SMALL_NODE_TAINT = {"key": "kvpilot.dev/small-node", "value": "true", "effect": "NoSchedule"}

# The pod sandbox's process: it holds the pod's namespaces and reaps orphans, as Kubernetes' pause does.
PAUSE_C = r"""
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void quit(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) {
    signal(SIGINT, quit);
    signal(SIGTERM, quit);
    signal(SIGCHLD, reap);
    for (;;) pause();
}
"""


def cannot_run_here() -> str | None:
    """Why nodes of the real kubelet cannot run on this machine, in a line with the way out; None when they can."""
    if os.geteuid() != 0:
        return "nodes of the real kubelet need root (containerd, runc, pod networks, buildah): run it as root"
    if not shutil.which("containerd", path=procs.sbin_path()["PATH"]) and not shutil.which("apt-get"):
        return (
            "nodes of the real kubelet need containerd, runc and the CNI plugins: install Debian's "
            f"({' '.join(RUNTIME_PACKAGES)}) or run it on Debian, where `make cluster-up` installs them"
        )
    return None


def ensure_runtime() -> None:
    """containerd, runc and the CNI plugins, from Debian (apt-get) when missing."""
    missing = [
        p
        for p in RUNTIME_PACKAGES
        if procs.run_tool("dpkg-query", "-W", "-f=${Status}", p, check=False).stdout != "install ok installed"
    ]
    if not missing:
        return
    log.info("installing %s (apt-get)", " ".join(missing))
    env = {**procs.sbin_path(), "DEBIAN_FRONTEND": "noninteractive"}
    argv = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    if subprocess.run(argv, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=True)
        subprocess.run(argv, env=env, capture_output=True, check=True)


def pause_image() -> str:
    """The sandbox image's reference in buildah's store, built once per source (gcc, buildah)."""
    digest = hashlib.sha256(PAUSE_C.encode()).hexdigest()[:12]
    ref = f"localhost/kvpilot-pause:{digest}"
    if procs.run_tool("buildah", "inspect", "--type", "image", ref, check=False).returncode == 0:
        return ref
    with tempfile.TemporaryDirectory() as tmp:
        src, binary = Path(tmp) / "pause.c", Path(tmp) / "pause"
        src.write_text(PAUSE_C)
        procs.run_tool("gcc", "-static", "-Os", "-s", "-o", binary, src)
        ctr = procs.run_tool("buildah", "from", "scratch").stdout.strip()
        try:
            procs.run_tool("buildah", "copy", ctr, binary, "/pause")
            procs.run_tool("buildah", "config", "--entrypoint", '["/pause"]', ctr)
            procs.run_tool("buildah", "commit", "--quiet", ctr, ref)
        finally:
            procs.run_tool("buildah", "rm", ctr, check=False)
    return ref


@dataclass
class KubeletNode:
    """One Node: its containerd and kubelet, started by `start()`, stopped (and the host put back) by `stop()`."""

    name: str
    control_plane: ControlPlane | None  # None: a node only to stop, what a killed run left (cli.py)
    workdir: Path
    gpus: int = 1
    # buildah image references to have in the node's containerd before pods start (pushed once, cached).
    images: tuple[str, ...] = ()
    taints: tuple[dict, ...] = ()  # registered with the Node (registerWithTaints)
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict, init=False)
    _api: client.ApiClient | None = field(default=None, init=False)
    _kubelet_argv: list[str] = field(default_factory=list, init=False)
    _slot_lock: int | None = field(default=None, init=False)
    _host_lock: int | None = field(default=None, init=False)

    # ---- names ------------------------------------------------------------
    # Each node claims a slot (_claim_slot), held by a lock file for the node's lifetime: it picks
    # the node's containerd store, bridge, /24 of pod addresses and cgroup root, so that nodes running at once
    # (of one cluster or of two) share none of them.
    @property
    def slot(self) -> int | None:
        try:
            return int((self.workdir / "slot").read_text())
        except (OSError, ValueError):
            return None

    def _named(self) -> int:
        if self.slot is None:
            raise RuntimeError(f"{self.name} has no slot: start() claims one")
        return self.slot

    @property
    def bridge(self) -> str:
        return f"kvpk{self._named()}"

    @property
    def pod_cidr(self) -> str:
        return f"{POD_NET_PREFIX}.{self._named()}.0/24"

    @property
    def ip(self) -> str:
        """The node's address: the bridge's, which the kubelet serves on and the host reaches pods from."""
        return f"{POD_NET_PREFIX}.{self._named()}.1"

    @property
    def cgroup_root(self) -> str:
        return f"/kvpilot-node{self._named()}"

    @property
    def store(self) -> Path:
        """containerd's root (content, snapshots, metadata), kept between runs so an image is imported once."""
        return CACHE / f"store-{self._named()}"

    def _claim_slot(self) -> None:
        """The first slot no running node holds, held with a lock for this node's life. The lock goes with the
        process: a killed run frees its slot, and what it left is cleaned up by the next holder."""
        for n in range(1, MAX_SLOTS + 1):
            if self._lock_slot(n):
                (self.workdir / "slot").write_text(str(n))
                self.store.mkdir(parents=True, exist_ok=True)
                return
        raise RuntimeError(f"all {MAX_SLOTS} kubelet node slots are in use (locks under {LOCKS})")

    def _lock_slot(self, n: int) -> bool:
        fd = lock_file(f"slot-{n}")
        if not try_flock(fd, fcntl.LOCK_EX):
            os.close(fd)
            return False
        self._slot_lock = fd
        return True

    @property
    def socket(self) -> Path:
        return self.run_dir / "containerd.sock"

    @property
    def run_dir(self) -> Path:
        """Where containerd and the kubelet keep their sockets, state and pod volumes: a short path of the slot's,
        since a unix socket's path must fit in 108 bytes (the kubelet's under a pytest tmp folder did not).
        Configs and logs stay in `workdir`."""
        return RUN_ROOT / str(self._named())

    def ctr(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
        """`ctr` against this node's containerd, in the CRI's namespace."""
        return procs.run_tool(
            "ctr", "--address", self.socket, "--namespace", "k8s.io", *args, timeout=timeout, check=check
        )

    @property
    def crictl_config(self) -> Path:
        """crictl's config for this node's containerd (`crictl --config <it> pods`; docs/cluster.md)."""
        return self.workdir / "crictl.yaml"

    def crictl(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        """`crictl` (built by hack/cluster/build.sh) against this node's containerd, as the kubelet sees it."""
        if self.control_plane is None:
            raise ValueError(f"{self.name}: crictl talks to a node started with a control plane")
        crictl = self.control_plane.bin_dir / "crictl"
        return procs.run_tool(crictl, "--config", self.crictl_config, *args, timeout=timeout, check=check)

    def log(self, component: str) -> Path:
        return self.workdir / f"{component}.log"

    # ---- lifecycle --------------------------------------------------------
    def start(self, timeout: float = 120) -> KubeletNode:
        if self.control_plane is None:
            raise ValueError(f"{self.name}: a node starts with a control plane")
        ensure_runtime()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._api = config.new_client_from_config(config_file=str(self.control_plane.kubeconfig))
        self._claim_slot()
        self._clean_slot()
        self._enter_host()
        try:
            pause_ref = pause_image()
            self._start_containerd(pause_ref)
            self._import_images(pause_ref)
            self._start_kubelet(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> bool:
        """Stop the kubelet, then every container of this node, then containerd; clean the slot; the last node
        of the host puts the host back. Safe to call twice and after a failed start; an error in one step does
        not skip the others. False when it left things alone: a killed run's node whose slot another running
        node holds now (that node cleaned up at its start)."""
        kubelet = self._procs.pop("kubelet", None)
        if kubelet is not None:
            procs.stop(kubelet, grace=10)
        containerd = self._procs.pop("containerd", None)
        if containerd is not None:
            _logged(self._remove_pods, f"{self.name}: removing its containers")
            procs.stop(containerd, grace=10)
        if self.slot is None:
            return True  # it never got as far as a slot: nothing of it is on the host
        if self._slot_lock is None and not self._lock_slot(self.slot):
            log.warning("%s: slot %d is another running node's now; leaving it alone", self.name, self.slot)
            return False
        _logged(self._clean_slot, f"{self.name}: cleaning slot {self.slot}")
        _logged(self._leave_host, f"{self.name}: putting the host back")
        if self._slot_lock is not None:
            os.close(self._slot_lock)
            self._slot_lock = None
        return True

    def _clean_slot(self) -> None:
        """Every process, mount, bridge and cgroup of this node's slot gone: at stop(), and at start() what a
        killed run that held the slot before left."""
        self._kill_shims()
        self._unmount_under(self.workdir)
        self._unmount_under(self.run_dir)
        if _mounts_under(self.run_dir):  # never delete through a mount: it may be a host folder's
            log.warning("%s: %s still has mounts; not removed", self.name, self.run_dir)
        else:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        self._unmount_under(self.store)
        self._delete_pod_netns()
        procs.run_tool("ip", "link", "delete", self.bridge, check=False)
        self._remove_cgroups()

    # ---- containerd -------------------------------------------------------
    def _start_containerd(self, pause_ref: str) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        state = self.run_dir / "containerd-state"
        net_d = self.workdir / "net.d"
        net_d.mkdir(exist_ok=True)
        (net_d / "10-kvpilot.conflist").write_text(json.dumps(self._cni_config(), indent=2))
        config = self.workdir / "containerd.toml"
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        config.write_text(
            textwrap.dedent(
                f"""\
                version = 2
                root = "{self.store}"
                state = "{state}"
                [grpc]
                  address = "{self.socket}"
                [ttrpc]
                  address = "{self.socket}.ttrpc"
                [debug]
                  address = ""
                [plugins."io.containerd.internal.v1.opt"]
                  path = "{self.run_dir / "opt"}"
                [{cri}]
                  sandbox_image = "{pause_ref}"
                  restrict_oom_score_adj = true
                  disable_apparmor = true
                  [{cri}.containerd.runtimes.runc]
                    runtime_type = "io.containerd.runc.v2"
                    [{cri}.containerd.runtimes.runc.options]
                      SystemdCgroup = false
                  [{cri}.cni]
                    bin_dir = "{CNI_BIN_DIR}"
                    conf_dir = "{net_d}"
                """
            )
        )
        self._procs["containerd"] = procs.spawn(
            ["containerd", "--config", str(config), "--log-level", "warn"],
            log_path=self.log("containerd"),
            env=procs.sbin_path(),
        )
        procs.wait_ready(
            self._procs["containerd"],
            lambda: self.socket.exists() and self.ctr("version", timeout=10, check=False).returncode == 0,
            30,
            "containerd",
            self.log("containerd"),
        )
        endpoint = f"unix://{self.socket}"
        self.crictl_config.write_text(
            f"runtime-endpoint: {endpoint}\nimage-endpoint: {endpoint}\ntimeout: 10\n"
        )

    def _cni_config(self) -> dict:
        return {
            "cniVersion": "1.0.0",
            "name": "kvpilot",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": True,
                    # pods route through the host: Service addresses (kube-proxy's DNAT) are reached that way
                    "isDefaultGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": self.pod_cidr, "gateway": self.ip}]],
                        "dataDir": str(self.workdir / "ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }

    def _import_images(self, pause_ref: str) -> None:
        wanted = [pause_ref, *self.images]
        aliases = {ref: _buildah_aliases(ref) for ref in self.images}
        have = set(self.ctr("images", "list", "--quiet").stdout.split())
        missing = [ref for ref in wanted if ref not in have]
        if missing:
            t0 = time.monotonic()
            log.info(
                "%s: importing %s from buildah's store (its layers the node lacks: minutes the first time)",
                self.name,
                " ".join(missing),
            )
            layout = registry.Layout(CACHE / "oci-layout")
            with layout.locked():
                layout.push(missing)  # not the others: pushing re-reads every layer (68 s for the project's)
                with registry.serving(layout) as host:
                    for ref in missing:
                        self._pull(f"{host}/{registry.REPOSITORY}:{registry.layout_tag(ref)}", ref)
            log.info("%s: imported in %.0f s", self.name, time.monotonic() - t0)
        # Earlier builds go after the import, not before: the layers a new build shares with them (the
        # dependencies', most of the image) are then in the store already, and containerd reuses them.
        self._prune_images(set(wanted), {a for names in aliases.values() for a in names})
        # The image's other names in buildah's store (`make image` tags :<version> and :latest too), so pods
        # may name it as a user's manifest does.
        for ref, names in aliases.items():
            for alias in names:
                self.ctr("images", "tag", "--force", ref, alias)

    def _prune_images(self, wanted: set[str], aliases: set[str]) -> None:
        """Earlier builds of the wanted images' repositories out of the store, so a store kept between runs holds
        one build, not one per change, and the CRI's `sha256:<id>` name of every build no other name is left to;
        containerd's garbage collector then frees the layers no image shares. The aliases (:latest) are tagged
        anew after this: the build they name now keeps no image."""
        repositories = {ref.rsplit(":", 1)[0] for ref in wanted}
        listing = [line.split() for line in self.ctr("images", "list").stdout.splitlines()[1:]]
        digest = {row[0]: row[2] for row in listing if len(row) > 2}
        named = {r for r in digest if not r.startswith("sha256:")}
        stale = {r for r in named - wanted - aliases if r.rsplit(":", 1)[0] in repositories}
        kept = {digest[r] for r in named - stale - aliases}
        stale |= {r for r in digest if r.startswith("sha256:") and digest[r] not in kept}
        if stale:
            log.info("%s: removing earlier images %s", self.name, " ".join(sorted(stale)))
            self.ctr("images", "remove", *sorted(stale))

    def _pull(self, remote: str, ref: str) -> None:
        """`remote` pulled (the blobs the store lacks; unpacked for the CRI) and named `ref`; the registry's
        name, whose port is this run's, removed."""
        self.ctr("images", "pull", "--plain-http", remote, timeout=1800)
        self.ctr("images", "tag", "--force", remote, ref)
        self.ctr("images", "remove", remote)
        if ref not in self.ctr("images", "list", "--quiet").stdout.split():
            raise RuntimeError(f"{self.name}: pulling {remote} did not give {ref}")

    # ---- kubelet ----------------------------------------------------------
    def _start_kubelet(self, timeout: float) -> None:
        cp = self.control_plane
        assert cp is not None  # start() checked
        d = self.workdir
        # The bridge first, with the node's address: the kubelet checks that --node-ip is one of the host's.
        if procs.run_tool("ip", "link", "show", self.bridge, check=False).returncode != 0:
            procs.run_tool("ip", "link", "add", self.bridge, "type", "bridge")
        procs.run_tool("ip", "addr", "replace", f"{self.ip}/24", "dev", self.bridge)
        procs.run_tool("ip", "link", "set", self.bridge, "up")
        for hierarchy in self._cgroup_hierarchies():
            (hierarchy / self.cgroup_root.lstrip("/")).mkdir(exist_ok=True)
        # Its client certificate: the Node authorizer's identity, bound to the system:node role below.
        pki_dir = cp.workdir / "pki"
        cert_name = f"node-{self.name}"
        pki.issue(
            cert_name,
            f"/O=system:nodes/CN=system:node:{self.name}",
            "extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature\n",
            pki_dir,
        )
        kubeconfig = cp.write_kubeconfig(
            d / "kubelet.kubeconfig",
            user=f"system:node:{self.name}",
            client_cert=(pki_dir / f"{cert_name}.crt", pki_dir / f"{cert_name}.key"),
        )
        port, healthz = procs.free_port(), procs.free_port()
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": self.ip,
            "port": port,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": healthz,
            "readOnlyPort": 0,
            # Only the API server (its kubelet-client certificate, signed by the cluster's CA) calls in.
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(cp.ca_cert)},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup_root,
            "failCgroupV1": False,
            "failSwapOn": False,
            "oomScoreAdj": 0,
            # Memory only: a kubelet short of disk deletes every image no container runs, the pause image
            # among them, and this node has no registry to pull them back from: no pod on it starts again.
            "evictionHard": {"memory.available": "100Mi"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "staticPodPath": str(d / "manifests"),
            # Its own, not /var/log/pods: a kubelet's log GC deletes the folders of pods it does not know.
            "podLogsDir": str(self.run_dir / "pod-logs"),
            "resolvConf": "/etc/resolv.conf",
            "serializeImagePulls": False,
            "nodeStatusUpdateFrequency": "4s",
            "nodeStatusReportFrequency": "10s",
            "syncFrequency": "10s",
            "fileCheckFrequency": "5s",
            "registerWithTaints": list(self.taints),
        }
        (d / "manifests").mkdir(exist_ok=True)
        (d / "kubelet.yaml").write_text(json.dumps(config, indent=2))  # JSON is YAML
        argv = [
            str(cp.bin_dir / "kubelet"),
            f"--config={d / 'kubelet.yaml'}",
            f"--kubeconfig={kubeconfig}",
            f"--root-dir={self.run_dir / 'kubelet'}",
            f"--cert-dir={self.run_dir / 'pki'}",  # its serving certificate; not under --root-dir by default
            f"--hostname-override={self.name}",
            f"--node-ip={self.ip}",
            "--v=1",
        ]
        self._bind_node_role()
        self._kubelet_argv = argv
        self.start_kubelet(timeout)
        if self.gpus:
            self._advertise_gpus()

    def start_kubelet(self, timeout: float = 120) -> None:
        """The kubelet (again, after stop_kubelet): returns once this kubelet has called the node Ready and
        knows every pod bound to it. Ready alone says little after a restart: the condition may be the dead
        kubelet's, and a new one answers `kubectl logs` with NotFound until it has read its pods."""
        started = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
        self._procs["kubelet"] = procs.spawn(
            self._kubelet_argv, log_path=self.log("kubelet"), env=procs.sbin_path()
        )
        procs.wait_ready(
            self._procs["kubelet"],
            lambda: self._node_ready(since=started) and self._kubelet_knows_its_pods(),
            timeout,
            f"node {self.name}",
            self.log("kubelet"),
        )

    def stop_kubelet(self) -> None:
        """The kubelet alone, as a crash would (SIGKILL): its containers go on running, the node's status goes
        stale, and the control plane calls the node NotReady after its grace period."""
        procs.stop(self._procs.pop("kubelet"), grace=0)

    def _bind_node_role(self) -> None:
        """The system:node ClusterRole for the group system:nodes (the API server runs RBAC alone here; a
        kubeadm cluster gets the same rights from the Node authorizer)."""
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "kvpilot-devcluster:nodes"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "system:node",
            },
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:nodes"}],
        }
        try:
            client.RbacAuthorizationV1Api(self._api).create_cluster_role_binding(binding)
        except ApiException as e:
            if e.status != 409:  # another node of this cluster made it
                raise

    def _node_ready(self, since: datetime.datetime) -> bool:
        try:
            node = client.CoreV1Api(self._api).read_node(self.name)
        except ApiException:
            return False
        return any(
            c.type == "Ready" and c.status == "True" and c.last_heartbeat_time >= since
            for c in node.status.conditions or ()
        )

    def _kubelet_knows_its_pods(self) -> bool:
        core = client.CoreV1Api(self._api)
        try:
            bound = core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.name}").items
            # The kubelet's own list, through the API server's node proxy (502 while it starts to listen).
            reply = core.connect_get_node_proxy_with_path(self.name, "pods", _preload_content=False)
            known = json.loads(reply.data)
        except ApiException:
            return False
        return {p.metadata.uid for p in bound} <= {p["metadata"]["uid"] for p in known.get("items") or []}

    def _advertise_gpus(self) -> None:
        """nvidia.com/gpu in the node's capacity, the way Kubernetes documents advertising an extended
        resource (a JSON patch of the node's status): GPU requests schedule as on a GPU node. The kubelet keeps
        extended resources it does not manage."""
        patch = [{"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": str(self.gpus)}]
        client.CoreV1Api(self._api).patch_node_status(self.name, patch)

    # ---- teardown ---------------------------------------------------------
    def _remove_pods(self) -> None:
        """Every pod of this node removed through the CRI, then every container left killed and removed from
        containerd's store, which outlives the run. The CRI's removal runs the CNI's DEL: it gives back the
        pod's address and port mappings and deletes its network namespace (in /run/netns, containerd's
        default); a container killed by `ctr` alone leaves both."""
        # Within `down`'s grace before it kills the run; a containerd that does not answer leaves it to `ctr`.
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            self.crictl("rmp", "--all", "--force", timeout=30, check=False)
        # Unchecked: the CRI plugin may remove a task or container between the list and the call.
        for task in self.ctr("tasks", "list", "--quiet", check=False).stdout.split():
            self.ctr("tasks", "kill", "--signal", "SIGKILL", task, timeout=30, check=False)
        time.sleep(1)
        for task in self.ctr("tasks", "list", "--quiet", check=False).stdout.split():
            self.ctr("tasks", "delete", "--force", task, timeout=30, check=False)
        for container in self.ctr("containers", "list", "--quiet", check=False).stdout.split():
            self.ctr("containers", "delete", container, timeout=30, check=False)

    def _kill_shims(self) -> None:
        """The containers of this node's slot and containerd's shims that held them: a kubelet and containerd
        that died (this node's, or a killed run's that held the slot before) leave them running. A shim names
        its containerd's socket, in the slot's run dir."""
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit():
                continue
            try:
                argv = (pid_dir / "cmdline").read_bytes().decode(errors="replace").split("\0")
                if not argv[0].endswith("containerd-shim-runc-v2") or "-address" not in argv[:-1]:
                    continue
                if Path(argv[argv.index("-address") + 1]).parent == self.run_dir:
                    os.killpg(int(pid_dir.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue
        deadline = time.monotonic() + 15
        while (pids := self._cgroup_pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)  # until they are gone: a cgroup with a process in it cannot be removed

    def _cgroup_pids(self) -> set[int]:
        pids = set()
        for hierarchy in self._cgroup_hierarchies(unified=True):
            for procs_file in (hierarchy / self.cgroup_root.lstrip("/")).rglob("cgroup.procs"):
                with contextlib.suppress(OSError):
                    pids.update(int(pid) for pid in procs_file.read_text().split())
        return pids

    def _delete_pod_netns(self) -> None:
        """The network namespaces of pods whose CNI DEL never ran (a killed run's, or a containerd that died):
        each pod's veth is on this node's bridge and names the namespace its peer is in. Left, each keeps a
        veth and a /run/netns mount on the host for good."""
        members = procs.run_tool("ip", "-o", "link", "show", "master", self.bridge, check=False).stdout
        for netns in sorted(set(re.findall(r"\blink-netns (\S+)", members))):
            procs.run_tool("ip", "netns", "delete", netns, check=False)

    @staticmethod
    def _unmount_under(folder: Path) -> None:
        """Unmount what containerd and the kubelet mounted below `folder` (rootfs overlays, shm, netns,
        volumes), deepest first."""
        for target in sorted(_mounts_under(folder), key=len, reverse=True):
            procs.run_tool("umount", "--lazy", target, check=False)

    @staticmethod
    def _cgroup_hierarchies(unified: bool = False) -> list[Path]:
        """The cgroup v1 hierarchies, the kubelet's cgroup root is made in; with `unified`, also the cgroup2
        one a hybrid host mounts at unified/, where runc makes each container's cgroup too (and removes it
        only when it deletes the container: a killed run leaves it there)."""
        return [
            p
            for p in CGROUP_FS.iterdir()
            if p.is_dir() and not p.is_symlink() and (unified or p.name != "unified")
        ]

    def _remove_cgroups(self) -> None:
        for hierarchy in self._cgroup_hierarchies(unified=True):
            root = hierarchy / self.cgroup_root.lstrip("/")
            if not root.exists():
                continue
            for group in sorted(
                (p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
            ):
                try:
                    group.rmdir()
                except OSError:
                    pass
            try:
                root.rmdir()
            except OSError as e:
                log.warning("%s: cgroup %s not removed: %s", self.name, root, e)

    # ---- what the kubelet changes on the host -----------------------------
    # Host-wide (sysctls, iptables, /var folders), so kept once for the host, not per node: every running node
    # holds a shared lock on `host`; the first to start writes what the host was like (HOST_STATE), the last to
    # stop puts it back. `setup` makes each of those steps one at a time. A killed run's locks go with it and
    # its HOST_STATE stays: the next first node keeps it (the true "before"), the next last one restores it.
    def _enter_host(self) -> None:
        with _held(lock_file("setup")):
            fd = lock_file("host")
            if try_flock(fd, fcntl.LOCK_EX) and not HOST_STATE.exists():
                HOST_STATE.write_text(json.dumps(_read_host_state()))
            fcntl.flock(fd, fcntl.LOCK_SH)
            self._host_lock = fd

    def _leave_host(self) -> None:
        with _held(lock_file("setup")):
            fd = self._host_lock if self._host_lock is not None else lock_file("host")
            self._host_lock = None
            try:
                if try_flock(fd, fcntl.LOCK_EX):
                    _restore_host_state()
                else:
                    log.info(
                        "%s: other kubelet nodes run on this host: the last to stop puts it back", self.name
                    )
            finally:
                os.close(fd)


def _read_host_state() -> dict:
    return {
        "sysctls": {
            k: (Path("/proc/sys") / k).read_text().strip()
            for k in SYSCTLS
            if (Path("/proc/sys") / k).exists()
        },
        "chains": sorted(_kube_chains()),
        "dirs": sorted(str(d) for d in HOST_DIRS if d.exists()),
    }


def _restore_host_state() -> None:
    try:
        saved = json.loads(HOST_STATE.read_text())
    except (OSError, ValueError):
        return
    for key, value in saved["sysctls"].items():
        try:
            (Path("/proc/sys") / key).write_text(value)
        except OSError as e:
            log.warning("sysctl %s not restored to %s: %s", key, value, e)
    for chain in _kube_chains() - {tuple(c) for c in saved["chains"]}:
        _remove_chain(*chain)
    for d in HOST_DIRS:
        if str(d) not in saved["dirs"]:
            shutil.rmtree(d, ignore_errors=True)
    HOST_STATE.unlink()


def slots_in_use() -> list[int]:
    """The slots running kubelet nodes hold now, of this cluster or another's (in this PID namespace): read
    from the kernel's table of held locks, /proc/locks, not by trying each one, which would make a node
    claiming a slot at that moment find it taken and start on another (with a store of its own to fill)."""
    probe = lock_file("probe")
    try:
        # The locks' filesystem as /proc/locks names it, from a lock of our own (on btrfs it is not stat's)
        fcntl.flock(probe, fcntl.LOCK_EX)
        held = _held_flocks()
        probe_inode = os.fstat(probe).st_ino
        device = next((dev for dev, inode, pid in held if inode == probe_inode and pid == os.getpid()), None)
    finally:
        os.close(probe)
    if device is None:  # /proc/locks names the pids of its own PID namespace: another's shows none of ours
        raise RuntimeError(f"/proc/locks shows no lock of this process on {LOCKS}: another PID namespace?")
    locked = {inode for dev, inode, _ in held if dev == device}
    in_use = []
    for n in range(1, MAX_SLOTS + 1):
        slot = LOCKS / f"slot-{n}.lock"
        if slot.exists() and slot.stat().st_ino in locked:
            in_use.append(n)
    return in_use


def _held_flocks() -> list[tuple[str, int, int]]:
    """(device as /proc/locks prints it, inode, pid) of each flock held now."""
    out = []
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 2192 fe:00:788169 0 EOF"; a waiter's line reads "1: -> FLOCK ..."
        if len(fields) > 5 and fields[1] == "FLOCK":
            device, _, inode = fields[5].rpartition(":")
            out.append((device, int(inode), int(fields[4])))
    return out


def lock_file(name: str) -> int:
    LOCKS.mkdir(parents=True, exist_ok=True)
    return os.open(LOCKS / f"{name}.lock", os.O_CREAT | os.O_RDWR, 0o644)


def try_flock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def _held(fd: int) -> Iterator[None]:
    """`fd`'s exclusive lock, waited for, held for the block; the descriptor closed after."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _logged(step: Callable[[], object], what: str) -> None:
    """`step()`, an error logged rather than raised: teardown goes on to its next step."""
    try:
        step()
    except Exception:
        log.exception("%s failed", what)


def _mounts_under(folder: Path) -> list[str]:
    prefix = str(folder.resolve()) + "/"
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return [m for m in mounts if m.startswith(prefix)]


def _buildah_aliases(ref: str) -> list[str]:
    """The other names of `ref`'s image in buildah's store."""
    listing = procs.run_tool(
        "buildah", "images", "--noheading", "--no-trunc", "--format", "{{.ID}} {{.Name}}:{{.Tag}}"
    )
    rows = [line.split() for line in listing.stdout.splitlines()]
    image_id = next((i for i, name in rows if name == ref), None)
    return [name for i, name in rows if i == image_id and name != ref]


def _kube_chains() -> set[tuple[str, str, str]]:
    """(command, table, chain) of every KUBE-* chain in iptables and ip6tables."""
    return {
        (command, table, line.split()[1])
        for command in ("iptables", "ip6tables")
        for table in IPTABLES_TABLES
        for line in procs.run_tool(command, "-t", table, "-S", check=False).stdout.splitlines()
        if line.startswith("-N KUBE-")
    }


def _remove_chain(command: str, table: str, chain: str) -> None:
    """The rules that jump to `chain`, then the chain itself."""
    for rule in procs.run_tool(command, "-t", table, "-S", check=False).stdout.splitlines():
        words = shlex.split(rule)
        if words[:1] == ["-A"] and words[-2:] == ["-j", chain]:
            procs.run_tool(command, "-t", table, "-D", *words[1:], check=False)
    procs.run_tool(command, "-t", table, "-F", chain, check=False)
    procs.run_tool(command, "-t", table, "-X", chain, check=False)


@contextlib.contextmanager
def kubelet_nodes(
    control_plane: ControlPlane,
    workdir: Path,
    count: int,
    gpus: int = 1,
    images: tuple[str, ...] = (),
    small_node: tuple[str, ...] | None = None,
) -> Iterator[list[KubeletNode]]:
    """`count` nodes (node-1, ...) with `images`, and, with `small_node`, one more with those images alone,
    tainted SMALL_NODE_TAINT; the Services they share (serviceproxy.py); started in order and stopped in
    reverse, also when one fails to start; the host put back."""
    from .serviceproxy import ServiceProxy  # it names this module's nodes' addresses

    nodes: list[KubeletNode] = []
    services = None
    try:
        shapes = [(images, ())] * count + (
            [(small_node, (SMALL_NODE_TAINT,))] if small_node is not None else []
        )
        for i, (node_images, taints) in enumerate(shapes, start=1):
            name = f"node-{i}"
            nodes.append(
                KubeletNode(name, control_plane, workdir / name, gpus=gpus, images=node_images, taints=taints)
            )
            nodes[-1].start()
        services = ServiceProxy(control_plane, workdir / "services", nodes[0].ip, f"{POD_NET_PREFIX}.0.0/16")
        services.start()
        yield nodes
    finally:
        if services is not None:
            _logged(services.stop, "stopping kube-proxy")
        for node in reversed(nodes):
            _logged(node.stop, f"stopping {node.name}")
