"""Binding pending pods to the agent's nodes while no kube-scheduler runs (the dev cluster starts none unless
asked): scheduling.py picks the node; here the Binding is written, or the pod's Unschedulable condition."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Collection

from kubernetes import client

from . import scheduling
from .kubeapi import MERGE, json_of, now

log = logging.getLogger("devcluster.agent")


class Binder:
    """Binds the pods no scheduler bound, each to the agent's node that fits best."""

    def __init__(
        self,
        core: client.CoreV1Api,
        coord: client.CoordinationV1Api,
        nodes: Collection[str],
        bind_pods: bool | None,
    ) -> None:
        self.core, self.coord, self.nodes = core, coord, nodes  # the agent's node names
        self.bind_pods = bind_pods  # None: bind only while no kube-scheduler holds its lease
        self.unschedulable: dict[str, str] = {}  # the reason last written, by pod uid

    def should_bind(self) -> bool:
        if self.bind_pods is not None:
            return self.bind_pods
        try:
            lease = json_of(
                self.coord.read_namespaced_lease("kube-scheduler", "kube-system", _preload_content=False)
            )
        except client.ApiException:
            return True
        renew = (lease.get("spec") or {}).get("renewTime")
        if not renew:
            return True
        age = dt.datetime.now(dt.UTC) - dt.datetime.fromisoformat(renew.replace("Z", "+00:00"))
        return age.total_seconds() > 30

    def bind(self, pending: list[dict], pods: list[dict]) -> None:
        nodes = [
            n
            for n in json_of(self.core.list_node(_preload_content=False))["items"]
            if n["metadata"]["name"] in self.nodes
        ]
        by_node: dict[str, list[dict]] = {}
        for p in pods:
            if p["spec"].get("nodeName") and (p.get("status") or {}).get("phase") not in (
                "Succeeded",
                "Failed",
            ):
                by_node.setdefault(p["spec"]["nodeName"], []).append(p)
        for pod in pending:
            if pod["spec"].get("schedulerName", "default-scheduler") != "default-scheduler":
                continue
            meta = pod["metadata"]
            target, why = scheduling.choose_node(pod, nodes, by_node)
            if target is None:
                self._mark_unschedulable(pod, why)
                continue
            body = {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": meta["name"], "uid": meta["uid"]},
                "target": {"apiVersion": "v1", "kind": "Node", "name": target},
            }
            try:
                self.core.create_namespaced_pod_binding(
                    meta["name"], meta["namespace"], body, _preload_content=False
                )
                by_node.setdefault(target, []).append(pod)
                log.info("bound %s/%s to %s", meta["namespace"], meta["name"], target)
            except client.ApiException as e:
                log.warning("binding %s/%s failed: %s", meta["namespace"], meta["name"], e.reason)

    def _mark_unschedulable(self, pod: dict, why: str) -> None:
        uid = pod["metadata"]["uid"]
        if self.unschedulable.get(uid) == why:
            return
        cond = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": why,
            "lastTransitionTime": now(),
            "lastProbeTime": None,
        }
        try:
            self.core.patch_namespaced_pod_status(
                pod["metadata"]["name"],
                pod["metadata"]["namespace"],
                {"status": {"conditions": [cond]}},
                _preload_content=False,
                _content_type=MERGE,
            )
            self.unschedulable[uid] = why
        except client.ApiException:
            pass
