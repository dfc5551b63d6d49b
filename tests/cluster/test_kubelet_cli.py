"""`devcluster.py up` and `down` as a user runs them (docs/cluster.md#real-nodes): two nodes of the
real kubelet and containerd, a pod on each, then the run killed as a crash would kill it, and `down` leaving
the host as it found it: no process, mount, bridge, cgroup, iptables chain, sysctl or folder of the nodes.
The image here is the nodes' own small pause image, so that this test imports nothing big (the project's
image on these nodes: test_kubelet_node.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from devcluster.kubeletnode import (
    HOST_DIRS,
    MAX_SLOTS,
    RUN_ROOT,
    SYSCTLS,
    _kube_chains,
    lock_file,
    pause_image,
    slots_in_use,
)
from support import ROOT
from support.cluster import needs_kubelet_node
from support.procs import wait_for

pytestmark = [
    pytest.mark.timeout(1800),  # a wait for other nodes to stop (600 s), then `up` and `down` (600 s each)
    needs_kubelet_node,
]

LAUNCHER = ROOT / "hack" / "cluster" / "devcluster.py"


def host_state() -> dict:
    """What kubelet nodes change on the host, and what they leave while they run."""
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {
        "sysctls": {
            k: (Path("/proc/sys") / k).read_text() for k in SYSCTLS if (Path("/proc/sys") / k).exists()
        },
        "chains": sorted(_kube_chains()),
        "bridges": sorted(w.rstrip(":") for w in links.split() if w.startswith("kvpk")),
        "cgroups": sorted(
            str(p) for h in Path("/sys/fs/cgroup").iterdir() if h.is_dir() for p in h.glob("kvpilot-node*")
        ),
        "var": [str(d) for d in HOST_DIRS if d.exists()],
        "mounts": [m for m in mounts if str(RUN_ROOT) in m or "containerd" in m or "kubelet" in m],
        "shims": sorted(p.name for p in Path("/proc").glob("[0-9]*") if _is_shim(p)),
        "netns": sorted(p.name for p in Path("/run/netns").glob("cni-*")),
    }


def _is_shim(proc: Path) -> bool:
    """A live containerd shim (an exited one that nobody reaped yet holds nothing)."""
    try:
        comm, state = (proc / "stat").read_text().split(") ", 1)
        return "containerd-shim" in comm and not state.startswith("Z")
    except (OSError, ValueError):
        return False


def devcluster(*args: str) -> subprocess.CompletedProcess:
    # The user's PATH may lack /usr/sbin (runc, iptables): the nodes must find them anyway.
    env = {**os.environ, "PATH": "/usr/local/bin:/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, str(LAUNCHER), *args], capture_output=True, text=True, timeout=600, env=env
    )


def test_up_kubelet_then_a_killed_run_and_down_leave_the_host_as_it_was(tmp_path: Path) -> None:
    # The host before and after is only this test's to compare when no other cluster's nodes start or stop
    # meanwhile (another `make test` or `make cluster-up` on this machine): wait for those to end.
    wait_for(
        lambda: not slots_in_use(),
        600,
        "no other kubelet nodes on this host: this test compares the whole host before and after its cluster",
        interval=5,
    )
    before = host_state()
    pause = pause_image()
    d = tmp_path / "cluster"
    kubectl = ["kubectl", f"--kubeconfig={d / 'kubeconfig'}"]
    try:
        up = devcluster("up", "--image", pause, "--nodes", "2", "--dir", str(d))
        assert up.returncode == 0, up.stdout + up.stderr + (d / "cluster.log").read_text()[-4000:]
        nodes = json.loads(subprocess.check_output([*kubectl, "get", "nodes", "-o", "json"]))["items"]
        assert sorted(n["metadata"]["name"] for n in nodes) == ["node-1", "node-2"]
        for n in nodes:
            assert n["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
            assert n["status"]["nodeInfo"]["kubeletVersion"] == "v1.37.2"
        spread = {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": "p"},
            "spec": {
                "selector": {"matchLabels": {"app": "p"}},
                "template": {
                    "metadata": {"labels": {"app": "p"}},
                    "spec": {"containers": [{"name": "p", "image": pause, "imagePullPolicy": "Never"}]},
                },
            },
        }
        subprocess.run([*kubectl, "apply", "-f", "-"], input=json.dumps(spread), text=True, check=True)

        def two_running() -> bool:
            pods = json.loads(subprocess.check_output([*kubectl, "get", "pods", "-o", "json"]))["items"]
            return sorted(
                p["spec"].get("nodeName", "") for p in pods if p["status"].get("phase") == "Running"
            ) == [
                "node-1",
                "node-2",
            ]

        wait_for(two_running, 120, "a pod running on each node", interval=1)
        assert host_state() != before, "the nodes changed nothing on the host: this test would prove nothing"
    finally:
        # A crash: the run and its kubelets and containerds die, their containers and shims run on.
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((d / "pid").read_text()), signal.SIGKILL)
        down = devcluster("down", "--dir", str(d))
    assert down.returncode == 0, down.stderr
    assert "cleaned up after kubelet nodes node-1, node-2" in down.stdout, down.stdout
    assert host_state() == before
    assert not list((d / "nodes").glob("node-*"))


def test_slots_in_use_names_a_slot_another_process_holds() -> None:
    """A slot held by another process is named while it is held, and not after (what the test above waits
    on)."""
    slot = MAX_SLOTS  # the last: a node takes it only when every other slot is in use
    os.close(lock_file(f"slot-{slot}"))  # the lock file exists, as after any node's first run
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(60)",
            str(RUN_ROOT / "locks" / f"slot-{slot}.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert slot in slots_in_use()
    finally:
        holder.kill()
        holder.wait()
    assert slot not in slots_in_use()
