"""The fleet's pods from its Service's EndpointSlices (`kvpilot router --fleet NAME`), kept current.

The operator gives each InferenceDeployment a Service of the same name; Kubernetes keeps one or more
EndpointSlices labelled `kubernetes.io/service-name=NAME` listing its pods. A thread lists and then watches
them (the kubernetes client is synchronous) and hands each new set of pods to the event loop; which
endpoints count is kvpilot.endpointslices' rule, shared with `kvpilot endpoint`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from kvpilot.endpointslices import SERVICE_LABEL, ready_endpoints
from kvpilot.router.pods import Pod

log = logging.getLogger(__name__)


def pods_from_slices(slices: list[dict[str, Any]], port_name: str = "http") -> list[Pod]:
    """Ready endpoints of the slices as pods, named after their Pod (else their address)."""
    return [Pod(e.name, e.url) for e in ready_endpoints(slices, port_name)]


class EndpointSliceWatch:
    """Calls `on_change(pods)` on the event loop with the fleet's ready pods, at start and on every change."""

    def __init__(self, name: str, namespace: str, on_change: Callable[[list[Pod]], None]) -> None:
        from kubernetes import client

        from kvpilot.kubeconfig import load

        load()  # run_router checked it: in-cluster, else the kubeconfig
        self._api = client.DiscoveryV1Api()
        self._client = client
        self.name = name
        self.namespace = namespace
        self._on_change = on_change
        self._loop = asyncio.get_running_loop()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpilot-endpointslices", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        from kubernetes import watch

        selector = f"{SERVICE_LABEL}={self.name}"
        while not self._stop.is_set():
            try:
                listed = self._api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector)
                slices = {s.metadata.name: self._plain(s) for s in listed.items}
                self._publish(slices)
                w = watch.Watch()
                for ev in w.stream(
                    self._api.list_namespaced_endpoint_slice,
                    self.namespace,
                    label_selector=selector,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=60,
                ):
                    obj = ev["object"]
                    if ev["type"] == "DELETED":
                        slices.pop(obj.metadata.name, None)
                    elif ev["type"] in ("ADDED", "MODIFIED"):
                        slices[obj.metadata.name] = self._plain(obj)
                    else:
                        break  # ERROR (e.g. 410 Gone): list again
                    self._publish(slices)
                    if self._stop.is_set():
                        return
            except Exception as exc:  # noqa: BLE001 - the API server may be away for a while: retry
                log.warning("EndpointSlices of %s/%s: %s; retrying", self.namespace, self.name, exc)
                self._stop.wait(2.0)

    def _plain(self, obj: Any) -> dict[str, Any]:
        return self._client.ApiClient().sanitize_for_serialization(obj)

    def _publish(self, slices: dict[str, dict[str, Any]]) -> None:
        pods = pods_from_slices(list(slices.values()))
        try:
            self._loop.call_soon_threadsafe(self._on_change, pods)
        except RuntimeError:
            self._stop.set()  # the loop is closed: the router is gone
