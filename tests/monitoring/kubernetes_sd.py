"""Prometheus' Kubernetes service discovery, served over HTTP service discovery.

Debian's prometheus 2.42 (what `make tools` unpacks) is built without `kubernetes_sd_configs`. This serves the
targets that discovery would find, with the same `__meta_kubernetes_*` labels (roles `pod` and
`endpointslice`, the ones the Prometheus Operator uses for PodMonitors and ServiceMonitors), read from the
API server at each request; Prometheus fetches them with `http_sd_configs` and applies the unchanged
relabeling. Labels follow Prometheus' discovery/kubernetes/{pod,endpointslice}.go.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kubernetes import client


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _labels(prefix: str, labels: dict[str, str] | None) -> dict[str, str]:
    out = {}
    for k, v in (labels or {}).items():
        out[f"{prefix}_label_{_sanitize(k)}"] = v
        out[f"{prefix}_labelpresent_{_sanitize(k)}"] = "true"
    return out


def _listed(namespaced: Callable[[str], Any], everywhere: Callable[[], Any], namespaces: list[str]) -> list:
    """The objects in `namespaces`, or in every namespace when none is named (kubernetes_sd's `namespaces`)."""
    if not namespaces:
        return everywhere().items
    return [o for ns in namespaces for o in namespaced(ns).items]


def _pod_meta(pod: client.V1Pod) -> dict[str, str]:
    ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
    return {
        "__meta_kubernetes_namespace": pod.metadata.namespace,
        "__meta_kubernetes_pod_name": pod.metadata.name,
        "__meta_kubernetes_pod_ip": pod.status.pod_ip or "",
        "__meta_kubernetes_pod_ready": str(ready).lower(),
        "__meta_kubernetes_pod_phase": pod.status.phase or "",
        "__meta_kubernetes_pod_node_name": pod.spec.node_name or "",
        "__meta_kubernetes_pod_uid": pod.metadata.uid,
        **_labels("__meta_kubernetes_pod", pod.metadata.labels),
    }


def _port_meta(prefix: str, container: client.V1Container, port: client.V1ContainerPort) -> dict[str, str]:
    return {
        f"{prefix}_container_name": container.name,
        f"{prefix}_container_port_name": port.name or "",
        f"{prefix}_container_port_number": str(port.container_port),
        f"{prefix}_container_port_protocol": port.protocol or "TCP",
    }


def pod_targets(core: client.CoreV1Api, namespaces: list[str]) -> list[dict[str, Any]]:
    """Role `pod`: one target per container port of each pod with an IP."""
    pods = _listed(core.list_namespaced_pod, core.list_pod_for_all_namespaces, namespaces)
    groups = []
    for pod in pods:
        if not pod.status.pod_ip:
            continue
        meta = _pod_meta(pod)
        for c in pod.spec.containers:
            for port in c.ports or []:
                groups.append(
                    {
                        "targets": [f"{pod.status.pod_ip}:{port.container_port}"],
                        "labels": {**meta, **_port_meta("__meta_kubernetes_pod", c, port)},
                    }
                )
    return groups


def endpointslice_targets(api: client.ApiClient, namespaces: list[str]) -> list[dict[str, Any]]:
    """Role `endpointslice`: one target per endpoint address and port, with its Service's and Pod's labels."""
    core, disc = client.CoreV1Api(api), client.DiscoveryV1Api(api)
    slices = _listed(
        disc.list_namespaced_endpoint_slice, disc.list_endpoint_slice_for_all_namespaces, namespaces
    )
    groups = []
    for es in slices:
        ns = es.metadata.namespace
        svc_name = (es.metadata.labels or {}).get("kubernetes.io/service-name")
        meta = {"__meta_kubernetes_namespace": ns, "__meta_kubernetes_endpointslice_name": es.metadata.name}
        if svc_name:
            svc = core.read_namespaced_service(svc_name, ns)
            meta |= {
                "__meta_kubernetes_service_name": svc_name,
                **_labels("__meta_kubernetes_service", svc.metadata.labels),
            }
        for ep in es.endpoints or []:
            ref = ep.target_ref
            pod = core.read_namespaced_pod(ref.name, ns) if ref is not None and ref.kind == "Pod" else None
            for port in es.ports or []:
                labels = {
                    **meta,
                    "__meta_kubernetes_endpointslice_port_name": port.name or "",
                    "__meta_kubernetes_endpointslice_port": str(port.port),
                    "__meta_kubernetes_endpointslice_port_protocol": port.protocol or "TCP",
                    "__meta_kubernetes_endpointslice_endpoint_conditions_ready": str(
                        bool(ep.conditions.ready)
                    ).lower(),
                }
                if ref is not None:
                    labels["__meta_kubernetes_endpointslice_address_target_kind"] = ref.kind
                    labels["__meta_kubernetes_endpointslice_address_target_name"] = ref.name
                if pod is not None:
                    labels |= _pod_meta(pod)
                    for c in pod.spec.containers:  # the container port the endpoint port points at
                        for cp in c.ports or []:
                            if cp.container_port == port.port:
                                labels |= _port_meta("__meta_kubernetes_pod", c, cp)
                groups += [{"targets": [f"{addr}:{port.port}"], "labels": labels} for addr in ep.addresses]
    return groups


class KubernetesSD:
    """An HTTP SD endpoint on loopback: GET /pod?namespaces=a,b and /endpointslice?namespaces=..."""

    def __init__(self, api: client.ApiClient) -> None:
        roles = {
            "/pod": lambda nss: pod_targets(client.CoreV1Api(api), nss),
            "/endpointslice": lambda nss: endpointslice_targets(api, nss),
        }

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                url = urllib.parse.urlparse(self.path)
                nss = [n for n in urllib.parse.parse_qs(url.query).get("namespaces", [""])[0].split(",") if n]
                try:
                    body, code = json.dumps(roles[url.path](nss)).encode(), 200
                except Exception as e:  # noqa: BLE001 - reported to Prometheus, which logs it
                    body, code = str(e).encode(), 500
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def sd_config(self, role: str, namespaces: list[str] | None) -> dict[str, Any]:
        """What replaces `kubernetes_sd_configs: [{role, namespaces: {names}}]` in a scrape config."""
        query = urllib.parse.urlencode({"namespaces": ",".join(namespaces or [])})
        return {"url": f"{self.url}/{role}?{query}", "refresh_interval": "2s"}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
