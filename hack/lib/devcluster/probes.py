"""A container's readiness and liveness probes: their schedule and counters, and one check (HTTP GET, TCP
connect or a command run in the container's namespaces) as the kubelet makes it."""

from __future__ import annotations

import socket
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # podrunner imports this module
    from .podrunner import Container


@dataclass
class Probe:
    """Schedule and counters of one probe (readiness or liveness)."""

    spec: dict
    next_at: float
    successes: int = 0
    failures: int = 0
    passing: bool = False


def check(spec: dict, c: Container, pod_ip: str) -> bool:
    """One try of the probe `spec` against container `c` of the pod at `pod_ip`: passed or not."""
    timeout = spec.get("timeoutSeconds", 1)
    try:
        if "httpGet" in spec:
            hg = spec["httpGet"]
            port = _port(hg["port"], c)
            host = hg.get("host") or pod_ip
            url = f"{hg.get('scheme', 'HTTP').lower()}://{host}:{port}{hg.get('path', '/')}"
            req = urllib.request.Request(url)
            for h in hg.get("httpHeaders") or []:
                req.add_header(h["name"], h["value"])
            try:
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    return 200 <= resp.status < 400
            except urllib.error.HTTPError as e:
                return 200 <= e.code < 400
        if "tcpSocket" in spec:
            port = _port(spec["tcpSocket"]["port"], c)
            with socket.create_connection((pod_ip, port), timeout=timeout):
                return True
        if "exec" in spec:
            argv = c.prefix + list(spec["exec"]["command"])
            r = subprocess.run(argv, env=c.env, cwd=c.cwd, capture_output=True, timeout=timeout)
            return r.returncode == 0
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return False
    return True  # grpc and unknown probe kinds: not checked, treated as passing


def _port(port: int | str, c: Container) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in c.spec.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"unknown named port {port}")
