"""Command line: start a dev cluster in the background, stop it, or run it in the foreground.

up     build if needed, start the control plane and nodes of the real kubelet, containerd
       and runc running the project's image (built if needed), detached; writes
       <dir>/kubeconfig and returns once pods can run
down   stop what `up` started and remove what a killed run left (containers, mounts,
       bridges, cgroups, the host's settings)
run    the same as up, in the foreground (Ctrl-C stops it)
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

from .binaries import REPO_ROOT
from .controlplane import ControlPlane
from .kubeletnode import NODE_MONITOR_GRACE_S, KubeletNode, cannot_run_here, kubelet_nodes

LAUNCHER = REPO_ROOT / "hack" / "cluster" / "devcluster.py"


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
    if not args.image:
        args.image = _build_image()
    stop = _stop_on_signals()
    d = Path(args.dir).resolve()
    (d / "ready").unlink(missing_ok=True)
    remove_leftover_nodes(d / "nodes")
    for folder in ("state", "nodes"):  # every `up` is a fresh cluster
        shutil.rmtree(d / folder, ignore_errors=True)
    users = {u: () for u in args.user}
    cp = ControlPlane(
        workdir=d / "state", extra_users=users, scheduler=True, node_monitor_grace_s=NODE_MONITOR_GRACE_S
    )
    with cp:
        cp.write_kubeconfig(d / "kubeconfig")
        for u in args.user:
            cp.write_kubeconfig(d / f"kubeconfig-{u}", user=u)
        mark_ready = lambda *_: (d / "ready").write_text(cp.url + "\n")  # noqa: E731
        run_kubelet_nodes(cp, d / "nodes", args.nodes, args.gpus, (args.image,), stop, on_ready=mark_ready)
    (d / "ready").unlink(missing_ok=True)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    d = Path(args.dir).resolve()
    d.mkdir(parents=True, exist_ok=True)
    if _running(d):
        print(f"dev cluster already running (pid {_pid(d)}); kubeconfig: {d / 'kubeconfig'}")
        return 0
    if problem := cannot_run_here():
        print(f"devcluster: {problem}", file=sys.stderr)
        return 2
    from .binaries import ensure_binaries

    ensure_binaries()  # in the foreground, so build progress shows
    image = args.image or _build_image()
    argv = [
        sys.executable,
        str(LAUNCHER),
        "run",
        "--dir",
        str(d),
        "--nodes",
        str(args.nodes),
        "--gpus",
        str(args.gpus),
    ]
    for u in args.user:
        argv += ["--user", u]
    argv += ["--image", image]
    with open(d / "cluster.log", "ab") as logf:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
        )
    (d / "pid").write_text(f"{proc.pid}\n")
    # A kubelet node imports the project's image into its containerd the first time: minutes, with progress.
    deadline = time.monotonic() + 1800
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
    nodes = remove_leftover_nodes(d / "nodes")
    print("dev cluster stopped" + (f"; cleaned up after kubelet nodes {', '.join(nodes)}" if nodes else ""))
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
        # Each node holds the project's image in a containerd store of its own: 11 GB of disk a node.
        s.add_argument("--nodes", type=int, default=1, help="nodes of the real kubelet (default 1)")
        s.add_argument("--gpus", type=int, default=1, help="nvidia.com/gpu capacity per node")
        s.add_argument("--user", action="append", default=[], help="extra token user without rights")
        s.add_argument(
            "--image",
            default="",
            help="import this image (buildah's) into the nodes instead of the project's",
        )
    s = sub.add_parser("down")
    s.add_argument("--dir", default=".cluster")
    args = p.parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack to the log
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return {"up": cmd_up, "down": cmd_down, "run": cmd_run}[args.cmd](args)
