"""The fleet's pods from its Service's EndpointSlices (`kvpilot router --fleet NAME`), kept current.

The operator gives each InferenceDeployment a Service of the same name; Kubernetes' endpointslice controller
keeps one or more EndpointSlices labelled `kubernetes.io/service-name=NAME` listing its pods. A thread lists
and then watches the controller's slices (the kubernetes client is synchronous) and hands each new set of pods
to the event loop; which endpoints are ready is kvpilot.kube.endpointslices' rule, shared with `kvpilot endpoint`.

Users' prompts and the fleet's admin token go to these pods, and anyone who may write an EndpointSlice in the
namespace (or run a pod with the fleet's labels) could list an address of their choosing. So an endpoint counts
only when its targetRef is a Pod of the fleet with that address (`FleetMembers`: the check the operator's
reset path makes, from kvpilot.kube.fleet_members).

A disaggregated fleet (spec.disaggregation) runs its pods in two workloads, NAME-prefill and NAME-decode: both
are the fleet's, and each pod's role is its label kvpilot.io/role, which makes the router run each request on
one pod of each role (router/disaggregation.py). A colocated fleet's pods have no role, whatever they wear.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvpilot.kube.endpointslices import MANAGED_BY, SERVICE_LABEL, Endpoint, dedup, slice_endpoints
from kvpilot.kube.fleet_members import (
    FLEET_LABEL,
    ROLE_LABEL,
    ROLES,
    is_disaggregated,
    is_member,
    pod_ips,
    pod_role,
    workload_controllers,
    workload_names,
)
from kvpilot.router.fleet.pods import Pod

log = logging.getLogger(__name__)
# The InferenceDeployment's API (the router imports nothing of the operator, whose builders name it too).
GROUP, VERSION, PLURAL = "kvpilot.io", "v1alpha1", "inferencedeployments"
_MAX_REPORTED = 1024  # refused endpoints remembered so that each is logged once


def vet(
    e: Endpoint, pod: dict[str, Any] | None, controllers: frozenset[str], disaggregated: bool, fleet: str
) -> tuple[Endpoint | None, str]:
    """(the endpoint as a member of InferenceDeployment `fleet`, with its Pod's role; or None and why it is
    not one). `pod`: the Pod its targetRef names, as listed (None: no such pod of the fleet's label);
    `controllers`: uids that directly control the fleet's pods (fleet_members.workload_controllers)."""
    if not e.pod:
        return None, "its targetRef is not a Pod"
    if pod is None or not is_member(pod, controllers):
        return None, f"Pod {e.pod} is not run by InferenceDeployment {fleet}'s workload"
    if e.ip not in pod_ips(pod):
        return None, f"{e.ip} is not the address of Pod {e.pod}"
    role = pod_role(pod, disaggregated)
    if disaggregated and role is None:
        # a pod of neither pool: the router would not know what to send it
        return None, f"Pod {e.pod} of a disaggregated fleet has no {ROLE_LABEL} label of {' or '.join(ROLES)}"
    return replace(e, role=role), ""


class FleetMembers:
    """Which endpoints are pods of InferenceDeployment `name`, read from the API at each call: the fleet, its
    workloads (one, or NAME-prefill and NAME-decode with spec.disaggregation), the ReplicaSets and the pods
    of the fleet's label (the router's Role allows exactly these reads)."""

    def __init__(self, api: Any, name: str, namespace: str) -> None:
        from kubernetes import client

        self._core, self._apps = client.CoreV1Api(api), client.AppsV1Api(api)
        self._custom = client.CustomObjectsApi(api)
        self.name, self.namespace = name, namespace
        self._reported: set[tuple[str, str]] = set()  # (endpoint, why) already logged

    def _get(self, read: Any, *args: Any) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            # a read's JSON is the object read
            obj: dict[str, Any] = json.loads(read(*args, _preload_content=False).data)
            return obj
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _items(self, list_: Any) -> list[dict[str, Any]]:
        r = list_(self.namespace, label_selector=f"{FLEET_LABEL}={self.name}", _preload_content=False)
        items: list[dict[str, Any]] = json.loads(r.data)["items"]  # a list's JSON: its objects
        return items

    def _controllers(self, fleet_uid: str, disaggregated: bool) -> frozenset[str]:
        """uids of the objects that directly control the fleet's pods, of every one of its workloads."""
        controllers: frozenset[str] = frozenset()
        replicasets: list[dict[str, Any]] | None = None  # listed once, for the first Deployment found
        for name in workload_names(self.name, disaggregated):
            wl = self._get(self._apps.read_namespaced_deployment, name, self.namespace)
            if wl is None:  # placement DaemonSet (never disaggregated: the API server refuses it)
                wl = self._get(self._apps.read_namespaced_daemon_set, name, self.namespace)
                controllers |= workload_controllers(fleet_uid, wl, ())
                continue
            if replicasets is None:
                replicasets = self._items(self._apps.list_namespaced_replica_set)
            controllers |= workload_controllers(fleet_uid, wl, replicasets)
        return controllers

    def members(self, endpoints: list[Endpoint]) -> list[Endpoint]:
        """The endpoints whose targetRef is a Pod run by the fleet's workloads, at the Pod's own address, each
        with the Pod's role."""
        read_fleet = self._custom.get_namespaced_custom_object
        fleet = self._get(read_fleet, GROUP, VERSION, self.namespace, PLURAL, self.name)
        controllers: frozenset[str] = frozenset()
        disaggregated = False
        if fleet is not None:
            disaggregated = is_disaggregated(fleet)
            controllers = self._controllers(fleet["metadata"]["uid"], disaggregated)
        pods = (
            {p["metadata"]["name"]: p for p in self._items(self._core.list_namespaced_pod)}
            if controllers
            else {}
        )
        out = []
        for e in endpoints:
            member, why = vet(e, pods.get(e.pod), controllers, disaggregated, self.name)
            if member is not None:
                out.append(member)
                continue
            if (e.url, why) not in self._reported:
                if len(self._reported) >= _MAX_REPORTED:
                    self._reported.clear()
                self._reported.add((e.url, why))
                log.warning(
                    "endpoint %s (%s) of %s/%s ignored: %s", e.name, e.url, self.namespace, self.name, why
                )
        return out


class EndpointSliceWatch:
    """Calls `on_change(pods)` on the event loop with the fleet's ready pods, at start and on every change."""

    def __init__(self, name: str, namespace: str, on_change: Callable[[list[Pod]], None]) -> None:
        from kubernetes import client

        from kvpilot.kube.kubeconfig import load

        load()  # run_router checked it: in-cluster, else the kubeconfig
        self._api = client.DiscoveryV1Api()
        self._client = client
        self._members = FleetMembers(self._api.api_client, name, namespace)
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

        selector = f"{SERVICE_LABEL}={self.name},{MANAGED_BY}"
        while not self._stop.is_set():
            try:
                # Any: the client's models type every field Optional; the API server's list and its items
                # have their metadata
                listed: Any = self._api.list_namespaced_endpoint_slice(
                    self.namespace, label_selector=selector
                )
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
        plain: dict[str, Any] = self._client.ApiClient().sanitize_for_serialization(obj)  # a model's JSON
        return plain

    def _publish(self, slices: dict[str, dict[str, Any]]) -> None:
        """The fleet's pods among the slices' ready endpoints, to the event loop (an API error raises: the
        watch starts over and the pods known so far stay)."""
        endpoints = self._members.members(slice_endpoints(list(slices.values())))
        pods = [Pod(e.name, e.url, role=e.role) for e in dedup(endpoints)]
        try:
            self._loop.call_soon_threadsafe(self._on_change, pods)
        except RuntimeError:
            self._stop.set()  # the loop is closed: the router is gone
