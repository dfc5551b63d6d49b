"""A Service's ready endpoints, read from its EndpointSlices (as the API returns them, plain dicts).

The fleet router follows them (`kvpilot router --fleet`) and `kvpilot endpoint` prints one; both parts read
them here, so neither imports the other. Endpoints that are not ready (starting, terminating) are left out, as a
Service leaves them out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SERVICE_LABEL = "kubernetes.io/service-name"  # the label that ties an EndpointSlice to its Service


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str  # its Pod's name, else IP:port
    url: str  # http://IP:PORT (IPv6 in brackets)


def ready_endpoints(slices: list[dict[str, Any]], port_name: str = "http") -> list[Endpoint]:
    """The ready endpoints of the slices on their port `port_name` (else their first port), sorted by name."""
    found: dict[str, Endpoint] = {}
    for s in slices:
        ports = s.get("ports") or []
        port = next((p.get("port") for p in ports if p.get("name") == port_name), None)
        if port is None and ports:
            port = ports[0].get("port")
        if port is None:
            continue
        for ep in s.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready") is False or not ep.get("addresses"):
                continue
            ip = ep["addresses"][0]
            host = f"[{ip}]" if ":" in ip else ip
            name = (ep.get("targetRef") or {}).get("name") or f"{ip}:{port}"
            found[name] = Endpoint(name, f"http://{host}:{port}")
    return sorted(found.values(), key=lambda e: e.name)
