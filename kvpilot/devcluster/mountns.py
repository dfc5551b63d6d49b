"""A private mount namespace per container, for the service-account folder.

In-cluster clients (`kubernetes.config.load_incluster_config()`, kopf) read
the token, `ca.crt` and `namespace` from one fixed path. Pods here are host
processes, so the path cannot simply hold a file: each container starts in its
own mount namespace (`unshare --mount`, propagation private, so nothing leaks
back to the host) where its pod's service-account folder is bind-mounted
read-only at that path. A pod without one (automountServiceAccountToken:
false) gets an empty folder there, so it never sees the host's or another
pod's token at that path. Needs root; see docs/cluster.md.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

SA_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
_SA_PATHS = {SA_PATH, SA_PATH.removeprefix("/var")}  # /var/run is /run on every current distro

# $1: the pod's folder, $2: SA_PATH, then the container's argv. exec keeps the pid, which the
# agent reports as the container's ID. Tools by absolute path: a pod may set its own PATH.
_SCRIPT = '{mkdir} -p "$2" && {mount} --bind -o ro "$1" "$2" && shift 2 && exec "$@"'


def available() -> bool:
    return os.geteuid() == 0


def sa_source(container: dict, volume_dirs: dict[str, Path]) -> Path | None:
    """The local folder of the volume a container mounts at the service-account path, if any."""
    for mount in container.get("volumeMounts") or []:
        if os.path.normpath(mount["mountPath"]) in _SA_PATHS and mount["name"] in volume_dirs:
            folder = volume_dirs[mount["name"]]
            return folder / mount["subPath"] if mount.get("subPath") else folder
    return None


def wrap(source: Path) -> list[str]:
    """argv prefix: run the rest in a new mount namespace with `source` at SA_PATH."""
    tool = {name: shutil.which(name) or name for name in ("unshare", "sh", "mkdir", "mount")}
    return [tool["unshare"], "--mount", "--propagation", "private", "--",
            tool["sh"], "-c", _SCRIPT.format(**tool), "kvpilot-pod-mounts", str(source), SA_PATH]  # fmt: skip
