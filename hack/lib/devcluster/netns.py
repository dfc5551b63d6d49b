"""Pod networking: one network namespace per pod, all joined to one bridge.

As root, each pod gets a namespace `<prefix>-<id>` with an `eth0` veth whose
peer sits on the bridge `<prefix>br`; the bridge holds the first address of the
pod range, so processes on the host (the tests) reach every pod IP directly.
Pods get no default route and ip_forward is left alone, so pod traffic stays
on the bridge.

Without root there are no namespaces: pods get loopback addresses from
127.<100+slot>.0.0/16 (all of 127/8 is local on Linux) and share the host's
network, so a container must bind its own pod IP (env from status.podIP)
rather than 0.0.0.0 to avoid port clashes.

Several clusters may run on one machine (parallel test runs): each claims a
"slot" with a lock file, which picks its names and its /16.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

MAX_SLOTS = 8  # 10.244/16 .. 10.251/16; none overlaps the 10.96/16 service range
LOCK_DIR = Path(tempfile.gettempdir())


def is_root() -> bool:
    return os.geteuid() == 0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


@dataclass
class PodNet:
    """The network identity of one pod."""

    ip: str
    netns: str | None  # None in loopback mode

    def exec_prefix(self) -> list[str]:
        """argv prefix that runs a command inside the pod's namespace."""
        return ["ip", "netns", "exec", self.netns] if self.netns else []


@dataclass
class Network:
    """The bridge and address range of one cluster run."""

    slot: int
    rootful: bool
    _lock_fd: int | None = None
    _used: set[str] = field(default_factory=set)

    @property
    def prefix(self) -> str:
        return f"kvp{self.slot}"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    @property
    def cidr(self) -> ipaddress.IPv4Network:
        second = 244 + self.slot if self.rootful else 100 + self.slot
        first = 10 if self.rootful else 127
        return ipaddress.IPv4Network(f"{first}.{second}.0.0/16")

    @property
    def host_ip(self) -> str:
        """The bridge's address (as root), which nodes report as their InternalIP."""
        return str(self.cidr.network_address + 1) if self.rootful else "127.0.0.1"

    def node_cidr(self, index: int) -> str:
        """A /24 per node, index 1..250, inside the slot's /16."""
        return str(list(self.cidr.subnets(new_prefix=24))[index])

    # ---- bridge ----------------------------------------------------------
    def setup(self) -> None:
        if not self.rootful:
            return
        self._remove_leftovers()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_ip}/{self.cidr.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def teardown(self) -> None:
        """Remove every namespace and link of this slot, then release the slot."""
        if self.rootful:
            self._remove_leftovers()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _remove_leftovers(self) -> None:
        for ns in list_netns(self.prefix):
            _ip("netns", "del", ns, check=False)
        out = _ip("-o", "link", "show", check=False).stdout
        for line in out.splitlines():
            name = line.split(":")[1].strip().split("@")[0]
            if name == self.bridge or name.startswith(f"{self.prefix}h"):
                _ip("link", "del", name, check=False)

    # ---- pods ------------------------------------------------------------
    def allocate_ip(self, node_index: int) -> str:
        subnet = ipaddress.IPv4Network(self.node_cidr(node_index))
        for addr in list(subnet.hosts())[1:]:  # .1 stays free, like a gateway would
            if str(addr) not in self._used:
                self._used.add(str(addr))
                return str(addr)
        raise RuntimeError(f"no free pod IP left in {subnet}")

    def add_pod(self, pod_id: str, node_index: int) -> PodNet:
        """Create the pod's namespace and wire it to the bridge; `pod_id` is short hex."""
        ip = self.allocate_ip(node_index)
        if not self.rootful:
            return PodNet(ip, None)
        ns, host_if, pod_if = f"{self.prefix}-{pod_id}", f"{self.prefix}h{pod_id}", f"{self.prefix}p{pod_id}"
        try:
            _ip("netns", "add", ns)
            _ip("link", "add", host_if, "type", "veth", "peer", "name", pod_if)
            _ip("link", "set", pod_if, "netns", ns)
            _ip("-n", ns, "link", "set", pod_if, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{ip}/{self.cidr.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "set", host_if, "master", self.bridge)
            _ip("link", "set", host_if, "up")
        except subprocess.CalledProcessError as e:
            self.remove_pod(PodNet(ip, ns))
            raise RuntimeError(f"pod network setup failed: {e.stderr.strip()}") from e
        return PodNet(ip, ns)

    def remove_pod(self, net: PodNet) -> None:
        """Delete the namespace (which destroys its veth pair) and free the IP."""
        if net.netns:
            _ip("netns", "del", net.netns, check=False)
            host_if = net.netns.replace(f"{self.prefix}-", f"{self.prefix}h", 1)
            _ip("link", "del", host_if, check=False)  # normally gone with the namespace
        self._used.discard(net.ip)


def bridge_addresses() -> list[str]:
    """The bridge address of every slot: pods reach the API server there (see apiproxy.py)."""
    return [Network(slot=n, rootful=True).host_ip for n in range(MAX_SLOTS)]


def list_netns(prefix: str) -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.split() and ln.split()[0].startswith(f"{prefix}-")]


def claim(rootful: bool | None = None, slot: int | None = None) -> Network:
    """Claim a free slot (held by a lock file for this process's lifetime) and return its Network."""
    if rootful is None:
        # KVPILOT_POD_NETWORK=loopback picks the non-root fallback even as root.
        rootful = is_root() and os.environ.get("KVPILOT_POD_NETWORK", "netns") != "loopback"
    candidates = [slot] if slot is not None else range(MAX_SLOTS)
    for n in candidates:
        path = LOCK_DIR / f"kvpilot-net-slot-{n}.lock"
        try:
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        except PermissionError:  # made by another user (root); flock works on a read-only fd
            fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return Network(slot=n, rootful=rootful, _lock_fd=fd)
    raise RuntimeError(f"all {MAX_SLOTS} network slots are in use (lock files in {LOCK_DIR})")
