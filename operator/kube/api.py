"""The operator's own Kubernetes API calls (kopf does its watching itself): the official client, run in
threads so the event loop never blocks, every call counted (metrics and the fan-out benchmark)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable, Mapping
from typing import Any, TypedDict, TypeVar, cast

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kvpilot.kube.kubeconfig import load
from kvpilot.operator import metrics
from kvpilot.operator.fleets import inference_pool
from kvpilot.operator.fleets.builders import GROUP, VERSION
from kvpilot.operator.kube.owners import owned_by

__all__ = ["FIELD_MANAGER", "ApiException", "Kube", "is_transient", "namespace_terminating"]

FIELD_MANAGER = "kvpilot-operator"

_T = TypeVar("_T")
_R = TypeVar("_R")
# A JSON object as the client hands it back: a custom object (its calls are annotated to return `object`)
# or a model object as sanitize_for_serialization makes it (not annotated)
_JsonObject = dict[str, Any]


class SecretView(TypedDict):
    """A Secret as Kube.secret reads it: its labels, owners, and data decoded."""

    labels: dict[str, str]
    ownerReferences: list[dict[str, Any]]
    data: dict[str, str]


def _same(pod: dict[str, Any]) -> Any:
    return pod


# kind -> (resource plural for metrics, API group attribute, read/patch/delete method stem)
_KINDS = {
    "Deployment": ("deployments", "apps", "deployment"),
    "DaemonSet": ("daemonsets", "apps", "daemon_set"),
    "Service": ("services", "core", "service"),
    "Secret": ("secrets", "core", "secret"),
    "ServiceAccount": ("serviceaccounts", "core", "service_account"),
    "RoleBinding": ("rolebindings", "rbac", "role_binding"),
    "NetworkPolicy": ("networkpolicies", "networking", "network_policy"),
}
# Custom kinds of other projects the operator writes: kind -> (group, version, plural). Their CRDs may be
# missing (Kube.serves tells); kvpilot's own resources have their own calls above.
_CUSTOM_KINDS = {"InferencePool": (inference_pool.GROUP, inference_pool.VERSION, inference_pool.PLURAL)}


def namespace_terminating(exc: ApiException) -> bool:
    """The namespace (and with it the owner) is going away: recreating what it deletes is neither possible
    nor wanted."""
    return "NamespaceTerminating" in str(exc.body or "") or "being terminated" in str(exc.body or "")


def is_transient(exc: BaseException) -> bool:
    """An API failure worth retrying: 5xx, 429, or no answer at all (connection refused, reset, timeout)."""
    if isinstance(exc, ApiException):
        return exc.status in (0, None, 429) or exc.status >= 500
    return isinstance(exc, (urllib3.exceptions.HTTPError, OSError))


class Kube:
    def __init__(self, api: client.ApiClient | None = None) -> None:
        if api is None:
            load()  # in-cluster, else the kubeconfig (kvpilot.kube.kubeconfig)
            cfg = client.Configuration.get_default_copy()
            cfg.connection_pool_maxsize = 32
            api = client.ApiClient(cfg)
        self.api = api
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.rbac = client.RbacAuthorizationV1Api(api)
        self.networking = client.NetworkingV1Api(api)

    async def call(self, verb: str, resource: str, fn: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
        metrics.API_CALLS.labels(verb, resource).inc()
        return await asyncio.to_thread(fn, *args, **kwargs)

    # ---- kvpilot custom resources ---------------------------------------
    async def get_cr(self, plural: str, ns: str, name: str) -> dict[str, Any] | None:
        try:
            obj = await self.call(
                "get", plural, self.custom.get_namespaced_custom_object, GROUP, VERSION, ns, plural, name
            )
            return cast(_JsonObject, obj)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def list_crs(self, plural: str, ns: str) -> list[dict[str, Any]]:
        r = await self.call(
            "list", plural, self.custom.list_namespaced_custom_object, GROUP, VERSION, ns, plural
        )
        return list(cast(_JsonObject, r).get("items") or [])

    async def patch_status(
        self, plural: str, ns: str, name: str, status: Mapping[str, object]
    ) -> dict[str, Any]:
        """A JSON merge patch of the object's status (each status module's typed shape: ResetStatus, ...)."""
        obj = await self.call(
            "patch",
            f"{plural}/status",
            self.custom.patch_namespaced_custom_object_status,
            GROUP,
            VERSION,
            ns,
            plural,
            name,
            {"status": status},
            _content_type="application/merge-patch+json",
        )
        return cast(_JsonObject, obj)

    async def create_cr(self, plural: str, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        obj = await self.call(
            "create", plural, self.custom.create_namespaced_custom_object, GROUP, VERSION, ns, plural, body
        )
        return cast(_JsonObject, obj)

    async def delete_cr(self, plural: str, ns: str, name: str, uid: str) -> None:
        try:
            await self.call(
                "delete",
                plural,
                self.custom.delete_namespaced_custom_object,
                GROUP,
                VERSION,
                ns,
                plural,
                name,
                body=client.V1DeleteOptions(
                    preconditions=client.V1Preconditions(uid=uid), propagation_policy="Background"
                ),
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    # ---- pods, replica sets and secrets -----------------------------------
    def list_pods_sync(
        self, ns: str, selector: str, shape: Callable[[dict[str, Any]], _T] = _same
    ) -> tuple[list[_T], str]:
        """(`shape(pod)` of each pod, the list's resourceVersion). Pods are plain dicts: the client's model
        classes cost many times the JSON's decoding (docs/fanout.md, "What bounds it"). Each pod is shaped as soon as the list is
        decoded, so only what `shape` keeps outlives this call."""
        # Any: with _preload_content=False the client returns the raw HTTP response, not the V1PodList it
        # is annotated with (likewise below)
        r: Any = self.core.list_namespaced_pod(ns, label_selector=selector, _preload_content=False)
        body: dict[str, Any] = json.loads(r.data)
        version: str = body["metadata"].get("resourceVersion", "")
        return [shape(p) for p in body.pop("items")], version

    async def list_pods(
        self, ns: str, selector: str, shape: Callable[[dict[str, Any]], _T] = _same
    ) -> tuple[list[_T], str]:
        return await self.call("list", "pods", self.list_pods_sync, ns, selector, shape)

    async def patch_pod_labels(self, ns: str, name: str, uid: str, labels: dict[str, str]) -> None:
        """Set labels on one pod, that pod only: the uid in the patch is a precondition (a pod of the same
        name made since is refused with 409)."""
        body = {"metadata": {"uid": uid, "labels": labels}}
        await self.call(
            "patch",
            "pods",
            self.core.patch_namespaced_pod,
            name,
            ns,
            body,
            _content_type="application/merge-patch+json",
        )

    async def patch_pod_condition(self, ns: str, name: str, uid: str, condition: dict[str, Any]) -> None:
        """Set one condition of one pod's status (a readiness gate's), that pod only (the uid a precondition):
        a strategic merge patch, merged by type, so the kubelet's own conditions are left as they are."""
        body = {"metadata": {"uid": uid}, "status": {"conditions": [condition]}}
        await self.call(
            "patch",
            "pods/status",
            self.core.patch_namespaced_pod_status,
            name,
            ns,
            body,
            _content_type="application/strategic-merge-patch+json",
        )

    async def list_replicasets(self, ns: str, selector: str) -> list[dict[str, Any]]:
        def fetch() -> list[dict[str, Any]]:
            r: Any = self.apps.list_namespaced_replica_set(
                ns, label_selector=selector, _preload_content=False
            )
            items: list[dict[str, Any]] = json.loads(r.data)["items"]
            return items

        return await self.call("list", "replicasets", fetch)

    async def secret(self, ns: str, name: str) -> SecretView | None:
        """The Secret as a dict with its data decoded, or None when it does not exist."""
        try:
            s = await self.call("get", "secrets", self.core.read_namespaced_secret, name, ns)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        data = {k: base64.b64decode(v).decode(errors="replace") for k, v in (s.data or {}).items()}
        meta = s.metadata or client.V1ObjectMeta()  # a Secret read from the API always has its metadata
        owners = self.api.sanitize_for_serialization(meta.owner_references or [])
        return {"labels": meta.labels or {}, "ownerReferences": owners, "data": data}

    async def config_map(self, ns: str, name: str) -> dict[str, str] | None:
        """The ConfigMap's `data` (its text keys), or None when it does not exist. The API server caps a
        ConfigMap at 1 MiB; what a caller may use of it is the caller's bound (warmups/prompts.py)."""
        try:
            cm = await self.call("get", "configmaps", self.core.read_namespaced_config_map, name, ns)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return dict(cm.data or {})

    async def create_secret(self, ns: str, body: dict[str, Any]) -> None:
        await self.call("create", "secrets", self.core.create_namespaced_secret, ns, body)

    async def serves(self, group: str, version: str, plural: str) -> bool:
        """Whether the API server serves that resource now (discovery, which every authenticated user may
        read): a CRD that is not installed, or not yet established, is not."""
        try:
            found = await self.call("get", "discovery", self.custom.get_api_resources, group, version)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.name == plural for r in found.resources or [])

    # ---- owned objects: server-side apply ----------------------------------
    def _resource(self, kind: str) -> str:
        return _CUSTOM_KINDS[kind][2] if kind in _CUSTOM_KINDS else _KINDS[kind][0]

    def _method(self, kind: str, verb: str) -> Any:
        if kind in _CUSTOM_KINDS:
            group_, version, plural = _CUSTOM_KINDS[kind]
            fn = getattr(self.custom, f"{'get' if verb == 'read' else verb}_namespaced_custom_object")
            # the typed calls' shape, (name, namespace, ...), so that apply, read and delete serve both
            return lambda name, ns, *a, **kw: fn(group_, version, ns, plural, name, *a, **kw)
        _, group, stem = _KINDS[kind]
        api = {"apps": self.apps, "core": self.core, "rbac": self.rbac, "networking": self.networking}[group]
        return getattr(api, f"{verb}_namespaced_{stem}")

    async def apply(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply as field manager kvpilot-operator, forced: fields we set are ours, fields we no
        longer set are removed, fields others set are kept. A no-op apply writes nothing."""
        kind = body["kind"]
        metrics.APPLIES.labels(ns, kind).inc()
        obj = await self.call(
            "apply",
            self._resource(kind),
            self._method(kind, "patch"),
            body["metadata"]["name"],
            ns,
            body,
            field_manager=FIELD_MANAGER,
            force=True,
            _content_type="application/apply-patch+yaml",
        )
        return cast(_JsonObject, self.api.sanitize_for_serialization(obj))

    async def read(self, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        try:
            obj = await self.call("get", self._resource(kind), self._method(kind, "read"), name, ns)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return cast(_JsonObject, self.api.sanitize_for_serialization(obj))

    async def delete_owned(self, kind: str, ns: str, name: str, owner_uid: str) -> bool:
        """Delete the object when `owner_uid` owns it, never someone else's of that name (it is read first).
        True when it was deleted."""
        old = await self.read(kind, ns, name)
        if old is None or not owned_by(old, owner_uid):
            return False
        await self.delete(kind, ns, name, old["metadata"]["uid"])
        return True

    async def delete(self, kind: str, ns: str, name: str, uid: str) -> None:
        try:
            await self.call(
                "delete",
                self._resource(kind),
                self._method(kind, "delete"),
                name,
                ns,
                body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
