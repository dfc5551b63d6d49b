"""etcd + kube-apiserver + kube-controller-manager on loopback.

Flags follow what controller-runtime's envtest does (loopback only, a static
token file, service-account keys made at start), plus RBAC authorization and
a kube-controller-manager, because the operator needs garbage collection,
Deployments, DaemonSets and service-account tokens to behave as in a cluster.
"""

from __future__ import annotations

import base64
import json
import secrets
import shutil
import ssl
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from . import binaries, pki, procs

SERVICE_CIDR = "10.96.0.0/16"  # must not overlap the pod ranges (kubeletnode.POD_NET_PREFIX)
# Names and addresses the apiserver's certificate is valid for: loopback for the host, and the in-cluster
# names and ClusterIP of the `kubernetes` Service that a kubelet's pods use (serviceproxy.py).
SERVING_HOSTS = [
    "127.0.0.1",
    "localhost",
    "10.96.0.1",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
]
ADMIN_GROUPS = ("system:masters",)


@dataclass(frozen=True)
class User:
    """A user of the static token file; groups decide what RBAC grants."""

    name: str
    token: str
    groups: tuple[str, ...] = ()


class StartupError(RuntimeError):
    pass


@dataclass
class ControlPlane:
    """One throwaway cluster; use as a context manager or call start()/stop()."""

    workdir: Path | None = None
    bin_dir: Path | None = None
    service_cidr: str = SERVICE_CIDR
    # Extra users for tests, e.g. {"dev": ()} gets a token and no rights.
    extra_users: dict[str, tuple[str, ...]] = field(default_factory=dict)
    verbose: int = 1
    # An audit policy (audit.k8s.io/v1 Policy as a dict): the apiserver then writes the events it selects to
    # `audit_log`, one JSON object a line, before it answers (the log backend's blocking mode).
    audit_policy: dict | None = None
    # kube-scheduler too: for nodes run by the real kubelet (kubeletnode.py); a control plane alone (tests of
    # the API, the operator's RBAC) schedules nothing.
    scheduler: bool = False
    # How long a node's status may go stale before the controllers call it NotReady (and its pods not Ready).
    node_monitor_grace_s: int = 40
    # More kube-apiserver flags, e.g. --enable-admission-plugins=...
    apiserver_args: tuple[str, ...] = ()
    users: dict[str, User] = field(default_factory=dict, init=False)
    url: str = field(default="", init=False)
    _procs: dict = field(default_factory=dict, init=False)
    _argv: dict = field(default_factory=dict, init=False)  # each process's flags, for restart_apiserver
    _own_workdir: bool = field(default=False, init=False)

    # ---- lifecycle -------------------------------------------------------
    def start(self, timeout: float = 90.0) -> ControlPlane:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="kvpilot-cluster-"))
            self._own_workdir = True
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.bin_dir = self.bin_dir or binaries.ensure_binaries()
        (self.workdir / "logs").mkdir(exist_ok=True)
        try:
            self._start_all(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop in reverse order; safe to call twice and after a failed start."""
        for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            proc = self._procs.pop(name, None)
            if proc is not None:
                procs.stop(proc, grace=5)
        if self._own_workdir and self.workdir and self.workdir.exists():
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def restart_apiserver(self, down_s: float = 0.0, timeout: float = 60.0) -> float:
        """Kill kube-apiserver (SIGKILL, as a crash would), keep it down `down_s`, start it again on the same
        port and flags; returns the seconds until it answered /readyz again. For fault tests: clients must
        ride out the gap."""
        t0 = time.monotonic()
        procs.stop(self._procs.pop("kube-apiserver"), grace=0)
        time.sleep(down_s)
        self._spawn("kube-apiserver", self._argv["kube-apiserver"])
        self._wait("kube-apiserver", time.monotonic() + timeout, lambda: self.request("/readyz")[0] == 200)
        return time.monotonic() - t0

    # ---- accessors -------------------------------------------------------
    @property
    def admin(self) -> User:
        return self.users["admin"]

    @property
    def ca_cert(self) -> Path:
        return self.workdir / "pki" / "ca.crt"

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def audit_log(self) -> Path:
        return self.workdir / "logs" / "audit.log"

    def audit_events(self) -> list[dict]:
        """The audit log's events so far (empty without an audit policy)."""
        try:
            lines = self.audit_log.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    def log(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    def write_kubeconfig(
        self, path: Path, user: str = "admin", client_cert: tuple[Path, Path] | None = None
    ) -> Path:
        """A kubeconfig for `user`'s token, or for the client certificate and key `client_cert` (a kubelet's
        identity) under the name `user` (JSON is valid YAML, so no YAML library is needed)."""
        ca = self.ca_cert.read_text()
        if client_cert:
            credentials = {"client-certificate": str(client_cert[0]), "client-key": str(client_cert[1])}
        else:
            credentials = {"token": self.users[user].token}

        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "kvpilot",
                    "cluster": {
                        "server": self.url,
                        "certificate-authority-data": base64.b64encode(ca.encode()).decode(),
                    },
                }
            ],
            "users": [{"name": user, "user": credentials}],
            "contexts": [{"name": f"kvpilot-{user}", "context": {"cluster": "kvpilot", "user": user}}],
            "current-context": f"kvpilot-{user}",
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cfg, indent=2) + "\n")
        path.chmod(0o600)
        return path

    def request(self, path: str, user: str = "admin", method: str = "GET") -> tuple[int, bytes]:
        """A raw HTTPS call to the apiserver, verified against our CA."""
        ctx = ssl.create_default_context(cafile=str(self.ca_cert))
        req = urllib.request.Request(self.url + path, method=method)
        req.add_header("Authorization", f"Bearer {self.users[user].token}")
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    # ---- internals -------------------------------------------------------
    def _start_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        wd = self.workdir
        keys = pki.generate(wd / "pki", SERVING_HOSTS)
        self._write_tokens()

        etcd_port, peer_port = procs.free_port(), procs.free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        self._spawn(
            "etcd",
            [
                "--name=default",
                f"--data-dir={wd / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync=true",  # throwaway data: skip fsync, a large win on slow disks
                "--log-level=warn",
            ],
        )
        self._wait("etcd", deadline, lambda: _http_ok(f"{etcd_url}/health"))

        api_port = procs.free_port()
        self.url = f"https://127.0.0.1:{api_port}"
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
                f"--cert-dir={wd / 'pki'}",
                f"--tls-cert-file={keys.serving_cert}",
                f"--tls-private-key-file={keys.serving_key}",
                f"--client-ca-file={keys.ca_cert}",
                f"--token-auth-file={wd / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                f"--service-cluster-ip-range={self.service_cidr}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={keys.sa_pub}",
                f"--service-account-signing-key-file={keys.sa_key}",
                # No endpoints of its own for the `kubernetes` Service (they would name 127.0.0.1, which pods
                # cannot reach): serviceproxy.py publishes a forwarder's instead.
                "--endpoint-reconciler-type=none",
                "--allow-privileged=true",
                "--enable-priority-and-fairness=false",  # fewer moving parts on 2 CPUs
                # `kubectl logs`, `exec`, `port-forward`: apiserver -> kubelet at the Node's InternalIP.
                f"--kubelet-client-certificate={keys.kubelet_client_cert}",
                f"--kubelet-client-key={keys.kubelet_client_key}",
                "--kubelet-preferred-address-types=InternalIP",
                f"--v={self.verbose}",
                *self._audit_args(),
                *self.apiserver_args,
            ],
        )
        self._wait("kube-apiserver", deadline, lambda: self.request("/readyz")[0] == 200)
        self.write_kubeconfig(self.kubeconfig)

        self._spawn(
            "kube-controller-manager",
            [
                f"--kubeconfig={self.kubeconfig}",
                "--controllers=*",  # every default-on controller: gc, deployments, daemonsets, SA, tokens...
                f"--service-account-private-key-file={keys.sa_key}",
                f"--root-ca-file={keys.ca_cert}",
                "--leader-elect=false",
                "--secure-port=0",  # no health endpoint needed: we wait on real controller work
                f"--node-monitor-grace-period={self.node_monitor_grace_s}s",
                f"--v={self.verbose}",
            ],
        )
        # The serviceaccount controller creating "default" proves controllers run.
        self._wait(
            "kube-controller-manager",
            deadline,
            lambda: self.request("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200,
        )
        if self.scheduler:
            self._spawn(
                "kube-scheduler",
                [
                    f"--kubeconfig={self.kubeconfig}",
                    "--leader-elect=false",
                    "--secure-port=0",
                    f"--v={self.verbose}",
                ],
            )

    def _audit_args(self) -> list[str]:
        if self.audit_policy is None:
            return []
        policy = self.workdir / "audit-policy.json"  # JSON is YAML: the apiserver reads either
        policy.write_text(json.dumps(self.audit_policy))
        return [
            f"--audit-policy-file={policy}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json",
            "--audit-log-mode=blocking",
        ]

    def _write_tokens(self) -> None:
        # Static token file: token,user,uid,"group1,group2". Read once at apiserver start,
        # hence test users are declared up front (extra_users).
        wanted = {"admin": ADMIN_GROUPS, **self.extra_users}
        lines = []
        for i, (name, groups) in enumerate(wanted.items()):
            user = User(name, secrets.token_hex(16), tuple(groups))
            self.users[name] = user
            lines.append(f'{user.token},{name},uid-{i},"{",".join(groups)}"')
        path = self.workdir / "tokens.csv"
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o600)

    def _spawn(self, name: str, args: list[str]) -> None:
        self._argv[name] = args
        argv = [str(self.bin_dir / name), *args]
        self._procs[name] = procs.spawn(argv, log_path=self.log(name))

    def _wait(self, name: str, deadline: float, ready) -> None:
        while time.monotonic() < deadline:
            for pname, proc in self._procs.items():
                if proc.poll() is not None:
                    raise StartupError(f"{pname} exited with {proc.returncode}:\n{_tail(self.log(pname))}")
            try:
                if ready():
                    return
            except (OSError, ssl.SSLError):
                pass  # not listening yet
            time.sleep(0.2)
        raise StartupError(f"{name} not ready in time:\n{_tail(self.log(name))}")


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return resp.status == 200


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"
