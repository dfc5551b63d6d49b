"""Who may talk to a fleet's daemons: its KV event keys (a Secret of CURVE key pairs, made once) and its
NetworkPolicy (`spec.networkPolicy`, server-side applied, removed when switched off). Only objects this
fleet owns are ever used, written or deleted: a name taken by anyone else is a problem reported on the
fleet's Ready condition, never adopted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import kopf

from kvpilot.kv import sockets as kv_sockets
from kvpilot.operator.fleets import builders, network_policy
from kvpilot.operator.fleets.network_policy import OperatorPeer
from kvpilot.operator.fleets.status import FleetStatus
from kvpilot.operator.kube.api import ApiException, Kube, namespace_terminating
from kvpilot.operator.kube.owners import as_body, owned_by
from kvpilot.operator.specs import FleetSpec

Problem = tuple[str, str]  # (reason, message) for the fleet's Ready condition


@dataclass(frozen=True, slots=True)
class PolicyState:
    name: str | None  # status.networkPolicy: the policy applied, None when off
    problem: Problem | None = None


def _taken(owner: dict[str, Any], kind: str, name: str, reason: str, what: str) -> Problem:
    msg = f"{kind} {name} already exists and is not this fleet's: {what}; rename or delete it"
    kopf.event(as_body(owner), type="Warning", reason=reason, message=msg)
    return reason, msg


async def ensure_kv_keys(
    kube: Kube, owner: dict[str, Any], spec: FleetSpec, logger: kopf.Logger
) -> Problem | None:
    """A fleet whose daemons publish KV events gets its key pairs once (never logged, never rewritten:
    running pods keep the keys they started with). A Secret of that name that is not the fleet's is never
    used: someone else may know its keys."""
    meta = owner["metadata"]
    if builders.kv_events_ports_by_rank(spec) is None:
        return None
    ns, name = meta["namespace"], builders.kv_keys_secret_name(meta["name"])
    live = await kube.read("Secret", ns, name)
    if live is None:
        files = kv_sockets.key_files(kv_sockets.SERVER) | kv_sockets.key_files(kv_sockets.CLIENT)
        body = builders.kv_keys_secret(meta["name"], files)
        kopf.adopt(body, owner=as_body(owner))
        try:
            await kube.create_secret(ns, body)
            logger.info("created Secret %s/%s with the fleet's KV event keys", ns, name)
            return None
        except ApiException as exc:
            if namespace_terminating(exc):
                return None
            if exc.status != 409:
                raise
        # 409: made meanwhile, by an earlier attempt of ours or by someone else: whose is it?
        live = await kube.read("Secret", ns, name)
    if live is None or owned_by(live, meta["uid"]):
        return None
    return _taken(owner, "Secret", name, "KVEventsKeysConflict", "the KV event keys cannot be trusted")


async def reconcile_policy(
    kube: Kube, owner: dict[str, Any], spec: FleetSpec, status: FleetStatus, peer: OperatorPeer
) -> PolicyState:
    meta = owner["metadata"]
    ns, uid = meta["namespace"], meta["uid"]
    name = network_policy.policy_name(meta["name"])
    if not network_policy.enabled(spec):
        # One read to remove it, only when there may be one: status names it, or the spec just changed.
        if status.get("networkPolicy") or meta.get("generation") != status.get("observedGeneration"):
            await kube.delete_owned("NetworkPolicy", ns, name, uid)
        return PolicyState(None)
    live = await kube.read("NetworkPolicy", ns, name)
    if live is not None and not owned_by(live, uid):
        return PolicyState(
            None,
            _taken(
                owner, "NetworkPolicy", name, "NetworkPolicyConflict", "the fleet's policy is not applied"
            ),
        )
    body = network_policy.network_policy(meta["name"], spec, peer)
    kopf.adopt(body, owner=as_body(owner))
    try:
        await kube.apply(ns, body)
    except ApiException as exc:
        if namespace_terminating(exc):
            return PolicyState(None)
        raise
    return PolicyState(name)
