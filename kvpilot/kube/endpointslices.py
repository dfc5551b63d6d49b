"""A Service's ready endpoints, read from its EndpointSlices (as the API returns them, plain dicts).

The fleet router follows them (`kvpilot router --fleet`) and `kvpilot endpoint` prints one; both parts read
them here, so neither imports the other. Endpoints that are not ready (starting, terminating) are left out, as a
Service leaves them out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SERVICE_LABEL = "kubernetes.io/service-name"  # the label that ties an EndpointSlice to its Service
# The slices Kubernetes' endpointslice controller writes from the Service's selector carry this label; anyone
# may write a slice with the Service's label by hand (and this one too: it is a first filter, not a proof).
MANAGED_BY = "endpointslice.kubernetes.io/managed-by=endpointslice-controller.k8s.io"


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str  # its Pod's name, else IP:port
    url: str  # http://IP:PORT (IPv6 in brackets)
    ip: str = ""
    pod: str = ""  # the name of the Pod its targetRef names; "" when it names none
    # The Pod's role in a disaggregated fleet (prefill, decode), set by the router's FleetMembers from the Pod
    # itself; a slice never says it.
    role: str | None = None


def ready_endpoints(slices: list[dict[str, Any]], port_name: str = "http") -> list[Endpoint]:
    """The ready endpoints of the slices on their port `port_name` (else their first port), one per name,
    sorted by name."""
    return dedup(slice_endpoints(slices, port_name))


def dedup(endpoints: list[Endpoint]) -> list[Endpoint]:
    """One endpoint per name (the last one listed), sorted by name."""
    return sorted({e.name: e for e in endpoints}.values(), key=lambda e: e.name)


def slice_endpoints(slices: list[dict[str, Any]], port_name: str = "http") -> list[Endpoint]:
    """Every ready endpoint of the slices on their port `port_name` (else their first port), as listed."""
    found: list[Endpoint] = []
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
            ref = ep.get("targetRef") or {}
            name = ref.get("name") or f"{ip}:{port}"
            pod = ref.get("name", "") if ref.get("kind") == "Pod" else ""
            found.append(Endpoint(name, f"http://{host}:{port}", ip, pod))
    return found
