"""Private mount (and UTS) namespaces per container, for what in-cluster clients read.

In-cluster clients (`kubernetes.config.load_incluster_config()`, kopf) read the
token, `ca.crt` and `namespace` from one fixed path, and some call the API
server by its name, `kubernetes.default.svc`. Pods here are host processes, so
each container starts in its own mount namespace (`unshare --mount`,
propagation private, so nothing leaks back to the host) where, read-only:

- its pod's service-account folder is bind-mounted at SA_PATH; a pod without
  one (automountServiceAccountToken: false) gets an empty folder there, so it
  never sees the host's or another pod's token at that path;
- a pod with its own network namespace gets its own /etc/hosts, as the
  kubelet writes it (localhost, the pod's IP and name, hostAliases), plus the
  `kubernetes` Service's names for the agent's forwarder, since there is no DNS;
  and its own UTS namespace with the pod's hostname, as in a real pod.

Needs root; see docs/cluster.md.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

SA_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
_SA_PATHS = {SA_PATH, SA_PATH.removeprefix("/var")}  # /var/run is /run on every current distro
SERVICE_NAMES = "kubernetes kubernetes.default kubernetes.default.svc kubernetes.default.svc.cluster.local"

# Arguments: the hostname (empty: keep the host's), pairs of (local path, path seen by the
# container), "--", the container's argv. exec keeps the pid, which the agent reports as the
# container's ID. Tools by absolute path: a pod may set its own PATH.
_SCRIPT = """if [ -n "$1" ]; then {hostname} "$1" || exit 127; fi
shift
while [ "$1" != -- ]; do
  if [ -d "$1" ]; then {mkdir} -p "$2" || exit 127; fi
  {mount} --bind -o ro "$1" "$2" || exit 127
  shift 2
done
shift; exec "$@"
"""


def available() -> bool:
    return os.geteuid() == 0


def sa_source(container: dict, volume_dirs: dict[str, Path]) -> Path | None:
    """The local folder of the volume a container mounts at the service-account path, if any."""
    for mount in container.get("volumeMounts") or []:
        if os.path.normpath(mount["mountPath"]) in _SA_PATHS and mount["name"] in volume_dirs:
            folder = volume_dirs[mount["name"]]
            return folder / mount["subPath"] if mount.get("subPath") else folder
    return None


def pod_hostname(pod: dict) -> str:
    """spec.hostname or the pod's name, cut to 63 characters as the kubelet does."""
    return (pod["spec"].get("hostname") or pod["metadata"]["name"])[:63].rstrip("-.")


def hosts_file(pod: dict, pod_ip: str, api_ip: str) -> str:
    """/etc/hosts for a pod with its own network namespace (the kubelet's, plus the API's names)."""
    lines = [
        "# Kubernetes-managed hosts file (kvpilot dev cluster node agent).",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        f"{pod_ip}\t{pod_hostname(pod)}",
        f"{api_ip}\t{SERVICE_NAMES}",
    ]
    aliases = pod["spec"].get("hostAliases") or []
    if aliases:
        lines.append("# Entries added by HostAliases.")
        lines += [f"{a['ip']}\t{' '.join(a.get('hostnames') or [])}" for a in aliases]
    return "\n".join(lines) + "\n"


def wrap(binds: list[tuple[Path, str]], hostname: str | None = None) -> list[str]:
    """argv prefix: run the rest with each local path mounted at its target (and `hostname`)."""
    tool = {name: shutil.which(name) or name for name in ("unshare", "sh", "mkdir", "mount", "hostname")}
    pairs = [str(arg) for local, target in binds for arg in (local, target)]
    uts = ["--uts"] if hostname else []
    return [
        tool["unshare"],
        "--mount",
        *uts,
        "--propagation",
        "private",
        "--",
        tool["sh"],
        "-c",
        _SCRIPT.format(**tool),
        "kvpilot-pod-mounts",
        hostname or "",
        *pairs,
        "--",
    ]
