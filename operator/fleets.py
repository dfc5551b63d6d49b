"""Reconcile an InferenceDeployment: its workload and Service as the builders say, its status, and the
annotation trigger. Idempotent: called on create/update/resume and by a timer (drift repair)."""

from __future__ import annotations

import copy
import logging
from typing import Any

import kopf

from kvpilot.operator import builders, metrics
from kvpilot.operator.conditions import fleet_conditions
from kvpilot.operator.kube import ApiException, Kube

FLEETS = "inferencedeployments"
_KEEP_TOKENS = 20


async def _ensure(
    kube: Kube, owner: dict[str, Any], desired: dict[str, Any], logger: logging.Logger
) -> dict | None:
    """Create `desired` or patch it back where someone changed what we set; return what is there."""
    kind, ns, name = desired["kind"], owner["metadata"]["namespace"], desired["metadata"]["name"]
    kopf.adopt(desired, owner=owner)
    actual = await kube.read(kind, ns, name)
    if actual is None:
        try:
            await kube.create(kind, ns, desired)
            logger.info("created %s %s/%s", kind, ns, name)
        except ApiException as exc:
            # 409: made meanwhile by a concurrent reconcile. NamespaceTerminating: the namespace (and with it
            # the InferenceDeployment) is going away; recreating what it deletes is neither possible nor wanted.
            if exc.status != 409 and "NamespaceTerminating" not in str(exc.body or ""):
                raise
        return None
    want = {"metadata": {"labels": desired["metadata"]["labels"],
                         "ownerReferences": desired["metadata"]["ownerReferences"]}, "spec": desired["spec"]}  # fmt: skip
    if builders.drifted(want, actual):
        await kube.patch(kind, ns, name, want)
        # A new generation of our spec is a rollout; anything else means someone changed our object.
        gen = owner["metadata"].get("generation")
        if gen is not None and gen != (owner.get("status") or {}).get("observedGeneration"):
            reason, what = "Updated", f"{kind} {name} updated to spec generation {gen}"
        else:
            reason, what = "DriftRepaired", f"{kind} {name} put back to its spec (it was changed)"
        kopf.event(owner, type="Normal", reason=reason, message=what)
        logger.info("%s", what)
    return actual


def _counts(kind: str, wl: dict[str, Any] | None, spec: dict[str, Any]) -> tuple[int, int, int, int, bool]:
    """(desired, replicas, ready, updated, stalled) of the workload."""
    if wl is None:
        return int(spec.get("replicas", 1)) if kind == "Deployment" else 0, 0, 0, 0, False
    st = wl.get("status") or {}
    if kind == "Deployment":
        stalled = any(
            c.get("type") == "Progressing" and c.get("status") == "False" for c in st.get("conditions") or []
        )
        return (int(wl["spec"].get("replicas", 1)), st.get("replicas", 0), st.get("readyReplicas", 0),
                st.get("updatedReplicas", 0), stalled)  # fmt: skip
    return (st.get("desiredNumberScheduled", 0), st.get("currentNumberScheduled", 0), st.get("numberReady", 0),
            st.get("updatedNumberScheduled", 0), False)  # fmt: skip


async def reconcile(kube: Kube, body: Any, logger: logging.Logger) -> None:
    owner = {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": dict(body["metadata"]),
             "status": dict(body.get("status") or {})}  # fmt: skip
    meta, spec = body["metadata"], dict(body.get("spec") or {})
    status = dict(body.get("status") or {})
    ns, name = meta["namespace"], meta["name"]
    kind = builders.workload_kind(spec)
    other = "DaemonSet" if kind == "Deployment" else "Deployment"

    wl = await _ensure(kube, owner, builders.workload(name, spec), logger)
    await _ensure(kube, owner, builders.service(name, spec), logger)
    # placement changed: the workload of the other kind goes (only if it is ours)
    old = await kube.read(other, ns, name)
    if old is not None and any(
        r.get("uid") == meta["uid"] for r in old["metadata"].get("ownerReferences") or []
    ):
        await kube.delete(other, ns, name)

    desired, replicas, ready, updated, stalled = _counts(kind, wl, spec)
    gen = meta.get("generation")
    new: dict[str, Any] = {
        "replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated,
        "selector": builders.selector_string(name), "observedGeneration": gen, "workload": f"{kind}/{name}",
        "conditions": fleet_conditions(status.get("conditions"), desired, ready, updated, gen or 0,
                                       wl is not None, stalled),
    }  # fmt: skip

    token = (meta.get("annotations") or {}).get(builders.RESET_ANNOTATION)
    tokens = list(status.get("resetTokens") or [])
    if token and token not in tokens:
        pcr = builders.reset_for_token(name, token, spec)
        kopf.adopt(pcr, owner=owner)
        try:
            await kube.create_cr("prefixcacheresets", ns, pcr)
            kopf.event(owner, type="Normal", reason="ResetRequested",
                       message=f"PrefixCacheReset {pcr['metadata']['name']} for annotation token {token!r}")  # fmt: skip
        except ApiException as exc:
            if exc.status != 409:  # 409: made before a crash, before the token reached status
                raise
        new["resetTokens"] = (tokens + [token])[-_KEEP_TOKENS:]

    metrics.READY_REPLICAS.labels(ns, name).set(ready)
    if any(status.get(k) != v for k, v in new.items()):
        await kube.patch_status(FLEETS, ns, name, copy.deepcopy(new))
