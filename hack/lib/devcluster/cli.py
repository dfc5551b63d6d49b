"""Command line: start a dev cluster in the background, stop it, or run parts.

up     build if needed, start the control plane and nodes of the real kubelet, containerd
       and runc running the project's image (built if needed), detached; writes
       <dir>/kubeconfig and returns once pods can run; with --node-agent, the Python
       node agent (pods as local processes of the venv) instead
down   stop what `up` started and remove what a killed run left (containers, mounts,
       bridges, pod namespaces)
run    the same as up, in the foreground (Ctrl-C stops it)
agent  only the node agent, against an existing cluster (tests use this)
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from kubernetes import config

from . import netns
from .binaries import REPO_ROOT
from .controlplane import ControlPlane
from .kubeletnode import KubeletNode, cannot_run_here, kubelet_nodes
from .nodeagent import NodeAgent, NodeSpec

LAUNCHER = REPO_ROOT / "hack" / "cluster" / "devcluster.py"


def node_specs(count: int, gpus: int) -> list[NodeSpec]:
    return [NodeSpec(name=f"node-{i + 1}", gpus=gpus) for i in range(count)]


def run_agent(
    kubeconfig: Path, workdir: Path, nodes: list[NodeSpec], stop: threading.Event, on_ready=None
) -> None:
    """Run a node agent until `stop` is set; always tears its networking down."""
    api = config.new_client_from_config(config_file=str(kubeconfig))
    agent = NodeAgent(api, netns.claim(), workdir, nodes)
    try:
        agent.start()
        logging.info(
            "node agent up: nodes %s, pod range %s", ", ".join(n.name for n in nodes), agent.network.cidr
        )
        if on_ready:
            on_ready(agent)
        while not stop.wait(1):  # a plain wait() would block signal handlers
            pass
    finally:
        agent.stop()


def run_kubelet_nodes(
    cp: ControlPlane,
    workdir: Path,
    count: int,
    gpus: int,
    images: tuple[str, ...],
    stop: threading.Event,
    on_ready=None,
) -> None:
    """Run `count` nodes of the real kubelet (kubeletnode.py) until `stop` is set; always stops them and puts the
    host back."""
    with kubelet_nodes(cp, workdir, count, gpus, images) as nodes:
        logging.info("kubelet nodes up: %s", ", ".join(f"{n.name} ({n.pod_cidr})" for n in nodes))
        if on_ready:
            on_ready()
        while not stop.wait(1):
            pass
    shutil.rmtree(workdir, ignore_errors=True)  # a killed run leaves it: remove_leftover_nodes


def remove_leftover_nodes(workdir: Path) -> list[str]:
    """What kubelet nodes whose run was killed left behind (containers, mounts, bridges, cgroups) removed, then
    their folders (a clean stop removes its own); the names of those nodes."""
    cleaned = []
    for folder in sorted(workdir.glob("node-*")):
        if KubeletNode(folder.name, None, folder).stop():
            shutil.rmtree(folder)  # after stop() unmounted what was mounted below it
            cleaned.append(folder.name)
    return cleaned


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def cmd_run(args: argparse.Namespace) -> int:
    if not args.node_agent and not args.image:
        args.image = _build_image()
    stop = _stop_on_signals()
    d = Path(args.dir).resolve()
    (d / "ready").unlink(missing_ok=True)
    remove_leftover_nodes(d / "nodes")
    for folder in ("state", "pods", "nodes"):  # every `up` is a fresh cluster
        shutil.rmtree(d / folder, ignore_errors=True)
    kubelet = {} if args.node_agent else {"scheduler": True, "node_monitor_grace_s": 16}
    cp = ControlPlane(workdir=d / "state", extra_users={u: () for u in args.user}, **kubelet)
    with cp:
        kubeconfig = cp.write_kubeconfig(d / "kubeconfig")
        for u in args.user:
            cp.write_kubeconfig(d / f"kubeconfig-{u}", user=u)
        mark_ready = lambda *_: (d / "ready").write_text(cp.url + "\n")  # noqa: E731
        if args.node_agent:
            nodes = node_specs(_node_count(args), args.gpus)
            run_agent(kubeconfig, d / "pods", nodes, stop, on_ready=mark_ready)
        else:
            run_kubelet_nodes(
                cp, d / "nodes", _node_count(args), args.gpus, (args.image,), stop, on_ready=mark_ready
            )
    (d / "ready").unlink(missing_ok=True)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    d = Path(args.dir).resolve()
    d.mkdir(parents=True, exist_ok=True)
    if _running(d):
        print(f"dev cluster already running (pid {_pid(d)}); kubeconfig: {d / 'kubeconfig'}")
        return 0
    if not args.node_agent and (problem := cannot_run_here()):
        print(f"devcluster: {problem}", file=sys.stderr)
        return 2
    from .binaries import ensure_binaries

    ensure_binaries()  # in the foreground, so build progress shows
    image = "" if args.node_agent else (args.image or _build_image())
    argv = [
        sys.executable,
        str(LAUNCHER),
        "run",
        "--dir",
        str(d),
        "--nodes",
        str(_node_count(args)),
        "--gpus",
        str(args.gpus),
    ]
    for u in args.user:
        argv += ["--user", u]
    argv += ["--image", image] if image else ["--node-agent"]
    with open(d / "cluster.log", "ab") as logf:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
        )
    (d / "pid").write_text(f"{proc.pid}\n")
    # A kubelet node imports the project's image into its containerd the first time: minutes, with progress.
    deadline = time.monotonic() + (1800 if image else 180)
    progress = _LogProgress(d / "cluster.log", "devcluster.kubelet")
    while time.monotonic() < deadline:
        progress.show()
        if proc.poll() is not None:
            print((d / "cluster.log").read_text()[-3000:], file=sys.stderr)
            print(
                f"dev cluster failed to start (exit {proc.returncode}); log: {d / 'cluster.log'}",
                file=sys.stderr,
            )
            return 1
        if (d / "ready").exists():
            print(f"dev cluster up: {(d / 'ready').read_text().strip()}  kubeconfig: {d / 'kubeconfig'}")
            print(f"  export KUBECONFIG={d / 'kubeconfig'}; kubectl get nodes")
            return 0
        time.sleep(0.5)
    print("dev cluster did not become ready in time; see " + str(d / "cluster.log"), file=sys.stderr)
    return 1


def _node_count(args: argparse.Namespace) -> int:
    """--nodes, else one node of the real kubelet (each holds the project's image in a containerd store of its
    own: 11 GB of disk a node) or two of the node agent (they cost nothing)."""
    if args.nodes is not None:
        return args.nodes
    return 2 if args.node_agent else 1


def _build_image() -> str:
    """The project's image (hack/image/build.sh: minutes when its inputs changed, else it only hashes), in the
    foreground so its progress shows; its content-hash reference."""
    script = REPO_ROOT / "hack" / "image" / "build.sh"
    return subprocess.run(
        ["bash", str(script)], check=True, stdout=subprocess.PIPE, text=True
    ).stdout.split()[-1]


class _LogProgress:
    """Prints the new lines of a log that come from one logger (the detached run's progress)."""

    def __init__(self, path: Path, logger: str) -> None:
        self.path, self.logger = path, logger
        self.offset = path.stat().st_size if path.exists() else 0

    def show(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                new = f.read()
        except OSError:
            return
        end = new.rfind(b"\n") + 1
        self.offset += end
        for line in new[:end].decode(errors="replace").splitlines():
            if f" {self.logger} " in line:
                print(line, flush=True)


def _pid(d: Path) -> int | None:
    try:
        return int((d / "pid").read_text())
    except (OSError, ValueError):
        return None


def _running(d: Path) -> bool:
    pid = _pid(d)
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by whoever adopted it) holds nothing
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def cmd_down(args: argparse.Namespace) -> int:
    d = Path(args.dir).resolve()
    pid = _pid(d)
    if pid is not None and _running(d):
        os.killpg(pid, signal.SIGTERM)  # `up` made it a session leader
        deadline = time.monotonic() + 40
        while _running(d) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _running(d):
            os.killpg(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while _running(d) and time.monotonic() < deadline:  # its locks go when it is gone
                time.sleep(0.1)
    (d / "pid").unlink(missing_ok=True)
    (d / "ready").unlink(missing_ok=True)
    removed = cleanup_stale_networks()
    nodes = remove_leftover_nodes(d / "nodes")
    print(
        "dev cluster stopped"
        + (f"; removed leftover networks of slots {removed}" if removed else "")
        + (f"; cleaned up after kubelet nodes {', '.join(nodes)}" if nodes else "")
    )
    return 0


def cleanup_stale_networks() -> list[int]:
    """Remove namespaces/links of every slot whose owner is gone (its lock is free)."""
    removed = []
    if not netns.is_root():
        return removed
    for n in range(netns.MAX_SLOTS):
        try:
            net = netns.claim(slot=n)
        except RuntimeError:
            continue  # a live cluster holds it
        leftover = netns.list_netns(net.prefix) or _link_exists(net.bridge)
        net.teardown()
        if leftover:
            removed.append(n)
    return removed


def _link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def cmd_agent(args: argparse.Namespace) -> int:
    stop = _stop_on_signals()
    ready = Path(args.workdir) / "agent-ready"

    def mark(agent: NodeAgent) -> None:
        ready.write_text(f"{agent.network.slot} {agent.network.cidr} {agent.network.host_ip}\n")

    run_agent(
        Path(args.kubeconfig), Path(args.workdir), node_specs(args.nodes, args.gpus), stop, on_ready=mark
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="hack/cluster/devcluster.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("up", "run"):
        s = sub.add_parser(name)
        s.add_argument("--dir", default=".cluster", help="state folder (kubeconfig, logs)")
        s.add_argument(
            "--nodes", type=int, default=None, help="nodes (default: 1 of the kubelet, 2 of the node agent)"
        )
        s.add_argument("--gpus", type=int, default=1, help="nvidia.com/gpu capacity per node")
        s.add_argument("--user", action="append", default=[], help="extra token user without rights")
        s.add_argument(
            "--node-agent",
            action="store_true",
            help="the Python node agent (pods as local processes of this venv) instead of the real kubelet",
        )
        s.add_argument(
            "--image",
            default="",
            help="kubelet nodes: import this image (buildah's) instead of the project's",
        )
    s = sub.add_parser("down")
    s.add_argument("--dir", default=".cluster")
    s = sub.add_parser("agent")
    s.add_argument("--kubeconfig", required=True)
    s.add_argument("--workdir", required=True)
    s.add_argument("--nodes", type=int, default=2)
    s.add_argument("--gpus", type=int, default=1)
    args = p.parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack to the log
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return {"up": cmd_up, "down": cmd_down, "run": cmd_run, "agent": cmd_agent}[args.cmd](args)
