"""Runs one pod's containers as local processes and tracks their status.

A PodRunner owns: the pod's network namespace (from netns.Network), its
volume folders (renewing projected tokens), one process group per container
(each in its own mount namespace, mountns.py), restarts per restartPolicy
(with a capped back-off) and readiness/liveness probes. It does not talk to
the API about status itself: the node agent reads `status()` and patches the
pod when it changes, so all API writes stay in one place.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import mountns, probes, procs
from .kubeapi import now
from .netns import Network, PodNet
from .podspec import SpecResolver
from .probes import Probe

log = logging.getLogger("devcluster.pod")
# The dev cluster's "image" is the venv the node agent runs from: its bin folder (kvpilot,
# python3 with the project's packages) comes first on every pod's PATH, as an image's PATH would.
IMAGE_BIN = sysconfig.get_path("scripts")


@dataclass
class Container:
    spec: dict
    argv: list[str]
    env: dict[str, str]
    cwd: str
    prefix: list[str] = field(default_factory=list)  # argv before the command: netns, mounts
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: str | None = None
    last_exit: dict | None = None  # the previous termination, for lastState
    exit_info: dict | None = None  # set while terminated
    next_start: float = 0.0
    readiness: Probe | None = None
    liveness: Probe | None = None

    @property
    def name(self) -> str:
        return self.spec["name"]


@dataclass
class PodRunner:
    pod: dict
    core: object  # kubernetes.client.CoreV1Api
    network: Network
    node_index: int
    host_ip: str
    workdir: Path
    api_env: dict[str, str] = field(default_factory=dict)  # KUBERNETES_SERVICE_* (apiproxy.service_env)
    net: PodNet | None = None
    resolver: SpecResolver | None = None
    hosts: Path | None = None  # the pod's /etc/hosts, when it has its own network namespace
    error: str | None = None
    containers: list[Container] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _started_at: str = field(default_factory=now)
    _grace_req: float = 30.0
    initialized: bool = False  # volumes written and init containers done
    _last_status: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.pod['metadata']['namespace']}/{self.pod['metadata']['name']}"

    @property
    def uid(self) -> str:
        return self.pod["metadata"]["uid"]

    @property
    def pod_dir(self) -> Path:
        return self.workdir / "pods" / self.uid

    # ---- lifecycle -------------------------------------------------------
    def start(self) -> None:
        """Set up network, volumes and processes in a thread; failures become pod status."""
        self._thread = threading.Thread(target=self._run, name=f"pod {self.key}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Setup is retried, as the kubelet does: a Secret or ConfigMap the pod
        # needs may be created after the pod.
        while not self._stop.is_set():
            try:
                self._prepare()
                with self._lock:
                    self.error, self.initialized = None, True
                break
            except Exception as e:  # noqa: BLE001 - any setup failure is reported on the pod
                log.warning("pod %s: setup failed (retrying): %s", self.key, e)
                with self._lock:
                    self.error = str(e)
                    self.containers = []
                    if self.net is not None and not self.pod["spec"].get("hostNetwork"):
                        self.network.remove_pod(self.net)
                    self.net = None
                self._stop.wait(2)
        while not self._stop.is_set():
            with self._lock:
                self._tick()
            self.resolver.refresh_tokens()  # outside the lock: an API call must not stall status()
            self._stop.wait(0.2)
        # Stopping happens on this thread because it forked the containers:
        # their PR_SET_PDEATHSIG would SIGKILL them the moment it exits.
        running = [c.proc for c in self.containers if c.proc is not None]
        waiters = [threading.Thread(target=procs.stop, args=(p, self._grace_req)) for p in running]
        for w in waiters:
            w.start()
        for w in waiters:
            w.join()

    def _prepare(self) -> None:
        self.pod_dir.mkdir(parents=True, exist_ok=True)
        if self.pod["spec"].get("hostNetwork"):
            self.net = PodNet(self.host_ip, None)  # shares the host's network, like the kubelet
        else:
            self.net = self.network.add_pod(self.uid.replace("-", "")[:8], self.node_index)
        # podIP must be known before env is resolved (fieldRef status.podIP).
        self.pod.setdefault("status", {})["podIP"] = self.net.ip
        self.pod["status"]["podIPs"] = [{"ip": self.net.ip}]
        self.pod["status"]["hostIP"] = self.host_ip
        if self.net.netns and mountns.available():
            self.hosts = self.pod_dir / "hosts"
            self.hosts.write_text(
                mountns.hosts_file(self.pod, self.net.ip, self.api_env["KUBERNETES_SERVICE_HOST"])
            )
        self.resolver = resolver = SpecResolver(self.core, self.pod, self.pod_dir)
        resolver.prepare_volumes()
        base = {
            **self.api_env,
            "PATH": os.pathsep.join([IMAGE_BIN, os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")]),
            "HOME": str(self.pod_dir),
            "HOSTNAME": mountns.pod_hostname(self.pod),
            "KVPILOT_POD_DIR": str(self.pod_dir),
        }
        if os.environ.get("PYTHONPATH"):
            base["PYTHONPATH"] = os.environ["PYTHONPATH"]
        for spec in self.pod["spec"]["containers"]:
            image = spec.get("image", "")
            if not spec.get("command"):
                raise ValueError(
                    f"container {spec['name']}: no command; images are not run here (image {image!r} ignored)"
                )
            log.info(
                "pod %s container %s: image %r ignored, running its command locally",
                self.key,
                spec["name"],
                image,
            )
            env = resolver.env(spec, base)
            cwd = resolver.rewrite_paths(spec.get("workingDir") or str(self.pod_dir), spec)
            c = Container(
                spec=spec, argv=resolver.argv(spec, env), env=env, cwd=cwd, prefix=self._prefix(spec)
            )
            t = time.monotonic()
            if spec.get("readinessProbe"):
                c.readiness = Probe(
                    spec["readinessProbe"], t + spec["readinessProbe"].get("initialDelaySeconds", 0)
                )
            if spec.get("livenessProbe"):
                c.liveness = Probe(
                    spec["livenessProbe"], t + spec["livenessProbe"].get("initialDelaySeconds", 0)
                )
                c.liveness.passing = True
            self.containers.append(c)
        self._run_init_containers(resolver, base)

    def _run_init_containers(self, resolver: SpecResolver, base: dict[str, str]) -> None:
        for spec in self.pod["spec"].get("initContainers") or []:
            env = resolver.env(spec, base)
            argv = resolver.argv(spec, env)
            proc = self._spawn(spec["name"], self._prefix(spec) + argv, env, str(self.pod_dir))
            while proc.poll() is None:
                if self._stop.wait(0.1):
                    procs.stop(proc, grace=1)
                    return
            procs.forget(proc)
            if proc.returncode != 0:
                raise RuntimeError(f"init container {spec['name']} exited with {proc.returncode}")

    def _prefix(self, spec: dict) -> list[str]:
        """What a container's command runs inside: the pod's network namespace, its own mounts."""
        if not mountns.available():
            return self.net.exec_prefix()
        sa_dir = mountns.sa_source(spec, self.resolver.volume_dirs)
        if sa_dir is None:  # automountServiceAccountToken: false
            sa_dir = self.pod_dir / "no-serviceaccount"
            sa_dir.mkdir(exist_ok=True)
        binds = [(sa_dir, mountns.SA_PATH)] + ([(self.hosts, "/etc/hosts")] if self.hosts else [])
        hostname = mountns.pod_hostname(self.pod) if self.hosts else None  # own network, own name
        return self.net.exec_prefix() + mountns.wrap(binds, hostname)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], cwd: str) -> subprocess.Popen:
        logs = self.pod_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        if not os.path.isdir(cwd):
            os.makedirs(cwd, exist_ok=True)
        return procs.spawn(argv, log_path=logs / f"{name}.log", env=env, cwd=cwd)

    def stop(self, grace: float) -> None:
        """SIGTERM every container, SIGKILL after `grace` seconds, then free the network."""
        self._grace_req = grace
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=grace + 15)
        if self.net is not None and not self.pod["spec"].get("hostNetwork"):
            self.network.remove_pod(self.net)
        shutil.rmtree(self.pod_dir, ignore_errors=True)

    # ---- supervision -----------------------------------------------------
    def _tick(self) -> None:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        t = time.monotonic()
        for c in self.containers:
            if c.proc is not None and c.proc.poll() is not None:
                self._on_exit(c, t)
            never_started = c.proc is None and c.exit_info is None
            if never_started or (c.exit_info is not None and self._should_restart(c, policy)):
                if t >= c.next_start:
                    self._start_container(c)
            if c.proc is not None:
                self._probe(c, t)

    def _start_container(self, c: Container) -> None:
        if c.exit_info is not None:
            c.restarts += 1
            c.last_exit, c.exit_info = c.exit_info, None
        c.proc = self._spawn(c.name, c.prefix + c.argv, c.env, c.cwd)
        c.started_at = now()
        if c.readiness:
            c.readiness.passing, c.readiness.successes, c.readiness.failures = False, 0, 0
            c.readiness.next_at = time.monotonic() + c.readiness.spec.get("initialDelaySeconds", 0)

    def _on_exit(self, c: Container, t: float) -> None:
        code = c.proc.returncode
        procs.forget(c.proc)
        procs.stop(c.proc, grace=0.5)  # reap anything the container left in its group
        c.exit_info = {
            "exitCode": code if code >= 0 else 128 - code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": c.started_at,
            "finishedAt": now(),
            "containerID": self._container_id(c),
        }
        c.proc = None
        # Back-off like the kubelet's, but capped low: 1s, 2s, 4s ... 10s.
        c.next_start = t + min(10.0, 2.0**c.restarts)
        log.info("pod %s container %s exited with %s", self.key, c.name, code)

    @staticmethod
    def _should_restart(c: Container, policy: str) -> bool:
        return policy == "Always" or (policy == "OnFailure" and c.exit_info["exitCode"] != 0)

    def _probe(self, c: Container, t: float) -> None:
        for probe, is_liveness in ((c.readiness, False), (c.liveness, True)):
            if probe is None or t < probe.next_at:
                continue
            spec = probe.spec
            probe.next_at = t + spec.get("periodSeconds", 10)
            ok = probes.check(spec, c, self.net.ip)
            if ok:
                probe.successes, probe.failures = probe.successes + 1, 0
                if probe.successes >= spec.get("successThreshold", 1):
                    probe.passing = True
            else:
                probe.failures, probe.successes = probe.failures + 1, 0
                if probe.failures >= spec.get("failureThreshold", 3):
                    probe.passing = False
                    if is_liveness:
                        log.info("pod %s container %s: liveness failed, restarting", self.key, c.name)
                        procs.stop(c.proc, grace=self._grace())
                        self._on_exit(c, t)
                        c.next_start = t  # a liveness kill restarts at once
                        probe.failures = 0
                        return

    def _grace(self) -> float:
        return float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))

    @staticmethod
    def _container_id(c: Container) -> str:
        # The host pid of the container's process (group leader): lets users
        # and tests find the process; opaque to Kubernetes itself.
        return f"kvpilot://{c.proc.pid}" if c.proc is not None else ""

    # ---- status ----------------------------------------------------------
    def status(self) -> dict:
        """The pod status as the kubelet would report it (phase, IPs, containers, conditions).

        While the runner thread is busy (a probe, a liveness kill) the previous
        status is returned, so one slow pod never stalls the agent's loop.
        """
        if self._lock.acquire(timeout=0.1):
            try:
                self._last_status = self._status()
            finally:
                self._lock.release()
        return self._last_status

    def _status(self) -> dict:
        spec = self.pod["spec"]
        policy = spec.get("restartPolicy", "Always")
        cstatuses, all_ready, any_running, all_done, any_failed = [], True, False, True, False
        for c in self.containers:
            cs = {
                "name": c.name,
                "image": c.spec.get("image", ""),
                "imageID": "",
                "restartCount": c.restarts,
                "started": c.proc is not None,
                "ready": False,
            }
            if c.proc is not None:
                ready = c.readiness.passing if c.readiness else True
                cs.update(
                    ready=ready,
                    containerID=self._container_id(c),
                    state={"running": {"startedAt": c.started_at}},
                )
                any_running = True
                all_done = False
            elif c.exit_info is not None:
                restarting = self._should_restart(c, policy)
                cs["state"] = (
                    {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off restarting container"}}
                    if restarting
                    else {"terminated": c.exit_info}
                )
                if restarting:
                    all_done = False
                    cs["lastState"] = {"terminated": c.exit_info}
                any_failed |= c.exit_info["exitCode"] != 0 and not restarting
            else:
                cs["state"] = {"waiting": {"reason": "ContainerCreating"}}
                all_done = False
            if c.last_exit and "lastState" not in cs:
                cs["lastState"] = {"terminated": c.last_exit}
            all_ready &= cs["ready"]
            cstatuses.append(cs)
        if self.error:
            phase, all_ready = "Pending", False
            cstatuses = [
                {
                    "name": c["name"],
                    "image": c.get("image", ""),
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "started": False,
                    "state": {"waiting": {"reason": "CreateContainerConfigError", "message": self.error}},
                }
                for c in spec["containers"]
            ]
        elif self.containers and all_done:
            phase = "Failed" if any_failed else "Succeeded"
        elif any_running or any(c.exit_info for c in self.containers):
            phase = "Running"
        else:
            phase = "Pending"
        all_ready = all_ready and bool(self.containers) and phase == "Running"
        started = self.net is not None
        conds = [
            ("PodReadyToStartContainers", started),
            ("Initialized", self.initialized),
            ("ContainersReady", all_ready),
            ("Ready", all_ready),
        ]
        status = {
            "phase": phase,
            "hostIP": self.host_ip,
            "hostIPs": [{"ip": self.host_ip}],
            "startTime": self._started_at,
            "containerStatuses": cstatuses,
            "conditions": [{"type": t, "status": "True" if ok else "False"} for t, ok in conds],
        }
        if self.net is not None:
            status["podIP"] = self.net.ip
            status["podIPs"] = [{"ip": self.net.ip}]
        if self.error:
            status["message"] = self.error
        return status
