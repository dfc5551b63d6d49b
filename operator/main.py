"""Run the operator: `kvpilot operator` or `python -m kvpilot.operator.main`."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, cast

import kopf
import uvloop

from kvpilot.operator.fleets.network_policy import DEFAULT_OPERATOR_LABELS, OperatorPeer
from kvpilot.operator.rbac import ROUTER_CLUSTER_ROLE

log = logging.getLogger("kvpilot.operator")


def _labels(text: str) -> dict[str, str]:
    """`k=v,k2=v2` as a dict; anything else is a usage error."""
    pairs = [kv.partition("=") for kv in text.split(",") if kv]
    if not pairs or any(not k or not sep or not v for k, sep, v in pairs):
        raise argparse.ArgumentTypeError(f"expected k=v,... (labels), got {text!r}")
    return {k: v for k, _, v in pairs}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; default: all namespaces)",
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="no peering: for a single replica (two standalone replicas would both act)",
    )
    p.add_argument(
        "--peering",
        default="kvpilot",
        help="kopf peering object shared by the replicas; created when missing (default %(default)s)",
    )
    p.add_argument(
        "--priority", type=int, default=0, help="peering priority of this replica (default %(default)s)"
    )
    p.add_argument(
        "--liveness-port", type=int, default=8080, help="port of GET /healthz (default %(default)s)"
    )
    p.add_argument(
        "--metrics-port", type=int, default=9090, help="Prometheus metrics port (default %(default)s)"
    )
    p.add_argument("--bind", default="0.0.0.0", help="address of the liveness and metrics servers")
    p.add_argument(
        "--router-cluster-role",
        default=None,
        help="ClusterRole that fleet routers get through a RoleBinding in their namespace; the operator "
        f"needs `bind` on it (the chart's is <release>-router). Not given: {ROUTER_CLUSTER_ROLE}, which the "
        "operator makes itself when it is missing (an operator run by hand, without the chart)",
    )
    p.add_argument(
        "--operator-namespace",
        default=os.environ.get("POD_NAMESPACE") or None,
        help="namespace of the operator's pods, which the fleets' NetworkPolicies let reach the daemons "
        "(default: $POD_NAMESPACE; none outside the cluster)",
    )
    p.add_argument(
        "--operator-pod-labels",
        type=_labels,
        default=dict(DEFAULT_OPERATOR_LABELS),
        help="labels of the operator's pods, as k=v,... (default: "
        + ",".join(f"{k}={v}" for k, v in DEFAULT_OPERATOR_LABELS.items())
        + ")",
    )
    p.add_argument(
        "--max-calls-in-flight",
        type=int,
        default=512,
        help="reset calls to pods in flight at once, across all resets (default %(default)s)",
    )


def ensure_router_role(name: str) -> None:
    """Make the fleet routers' ClusterRole when it is missing: without the chart (an operator run by hand
    with the user's own credentials) nothing else would, and every fleet router would be refused its
    EndpointSlices. The chart ships the role and names it, so this never runs there."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    from kvpilot.operator.kube.api import Kube
    from kvpilot.operator.rbac import router_cluster_role

    rbac = client.RbacAuthorizationV1Api(Kube().api)
    try:
        rbac.read_cluster_role(name)
        return
    except ApiException as exc:
        if exc.status != 404:
            log.warning(
                "cannot read ClusterRole %s (HTTP %s %s): fleet routers need it", name, exc.status, exc.reason
            )
            return
    try:
        # the client sends a dict body as it is; its annotation names only its model class
        rbac.create_cluster_role(router_cluster_role(name))  # type: ignore[arg-type]
        log.info("created ClusterRole %s: what fleet routers may read (the chart ships its own)", name)
    except ApiException as exc:
        if exc.status != 409:
            log.warning(
                "cannot create ClusterRole %s (HTTP %s %s): fleet routers will be refused their "
                "EndpointSlices; install the chart's RBAC",
                name,
                exc.status,
                exc.reason,
            )


def ensure_peering(name: str, namespaces: list[str]) -> bool:
    """Make sure the peering object exists (kopf waits silently for a missing one). Returns False, after a
    warning, when the peering CRDs are not installed: the operator then runs standalone."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    from kvpilot.operator.kube.api import Kube

    kube = Kube()
    crd = "kopfpeerings.kopf.dev" if namespaces else "clusterkopfpeerings.kopf.dev"
    try:
        found = client.ApiextensionsV1Api(kube.api).list_custom_resource_definition(
            field_selector=f"metadata.name={crd}"
        )
    except ApiException as exc:
        log.warning(
            "cannot look for the CRD %s (HTTP %s %s): assuming peering; if the peering object %s is "
            "missing, kopf waits without acting",
            crd,
            exc.status,
            exc.reason,
            name,
        )
        return True
    if not found.items:
        log.warning(
            "CRD %s is not installed (kubectl apply -f crds/): running standalone, without peering; "
            "run one replica only",
            crd,
        )
        return False
    body = {"apiVersion": "kopf.dev/v1", "metadata": {"name": name}}
    try:
        if namespaces:
            for ns in namespaces:
                kube.custom.create_namespaced_custom_object(
                    "kopf.dev", "v1", ns, "kopfpeerings", {**body, "kind": "KopfPeering"}
                )
        else:
            kube.custom.create_cluster_custom_object(
                "kopf.dev", "v1", "clusterkopfpeerings", {**body, "kind": "ClusterKopfPeering"}
            )
        log.info("created the peering object %s", name)
    except ApiException as exc:
        if exc.status != 409:  # 409: it exists
            log.warning(
                "cannot create the peering object %s (HTTP %s %s): if it is missing, kopf waits without "
                "acting; create it or run with --standalone",
                name,
                exc.status,
                exc.reason,
            )
    return True


def warn_about_equal_peers(name: str, priority: int) -> None:
    """kopf pauses every replica of equal priority: say so at startup instead of idling in silence."""
    from kvpilot.operator.kube.api import Kube

    try:
        obj = cast(  # the decoded JSON object
            dict[str, Any],
            Kube().custom.get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", name),
        )
    except Exception:  # noqa: BLE001 - namespaced peering, or no access: nothing to say
        return
    same = [
        peer
        for peer, info in (obj.get("status") or {}).items()
        if isinstance(info, dict) and info.get("priority") == priority
    ]
    if same:
        log.warning(
            "peering %s already lists %s with priority %d: replicas of equal priority all pause (kopf's "
            "rule); run one replica (supported mode) or give them distinct --priority",
            name,
            ", ".join(same),
            priority,
        )


def prepare(args: argparse.Namespace) -> tuple[bool, str]:
    """What comes before kopf starts: peering (or standalone), the fleet routers' ClusterRole, the start line.
    Returns (standalone, the routers' ClusterRole)."""
    standalone = args.standalone or not ensure_peering(args.peering, args.namespace)
    if not standalone and not args.namespace:
        warn_about_equal_peers(args.peering, args.priority)
    log.info(
        "kvpilot operator: watching %s, %s; metrics on %s:%d, GET /healthz on %s:%d",
        ", ".join(args.namespace) or "all namespaces",
        "standalone (no peering)"
        if standalone
        else f"peering {args.peering!r} with priority {args.priority}",
        args.bind,
        args.metrics_port,
        args.bind,
        args.liveness_port,
    )
    router_role = args.router_cluster_role or ROUTER_CLUSTER_ROLE
    if args.router_cluster_role is None:
        ensure_router_role(router_role)
    return standalone, router_role


def run(args: argparse.Namespace) -> int:
    from urllib3.exceptions import MaxRetryError

    from kvpilot.operator import handlers, logs, metrics  # noqa: F401 - importing handlers registers them with kopf
    from kvpilot.operator.cli_follow import api_error

    logs.install()
    # Bound before anything touches the cluster: a port in use fails the start at once, in one line.
    try:
        metrics.serve(args.metrics_port, args.bind)
    except OSError as exc:
        print(
            f"error: cannot serve metrics on {args.bind}:{args.metrics_port}: {exc.strerror or exc} "
            "(another process has that port? --metrics-port picks another)",
            file=sys.stderr,
        )
        return 2
    try:
        standalone, router_role = prepare(args)
    except MaxRetryError as exc:  # kopf, once it runs, retries its own calls
        print(f"error: {api_error(exc)}", file=sys.stderr)
        return 2
    # What the imports built (kopf, the Kubernetes client and its models, aiohttp) lives as long as the process:
    # out of the cyclic GC's sight, a full collection during a fan-out scans ~10x fewer objects (docs/fanout.md).
    gc.freeze()
    # uvloop, as kopf's own CLI uses when installed: a fan-out's cost is mostly connecting and event-loop
    # turns (one connection per pod), which uvloop makes cheaper (docs/fanout.md).
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(
            kopf.operator(
                clusterwide=not args.namespace,
                namespaces=args.namespace,
                standalone=standalone,
                priority=args.priority,
                peering_name=None if standalone else args.peering,
                liveness_endpoint=f"http://{args.bind}:{args.liveness_port}/healthz",
                # Read by the startup handler (handlers.configure); every handler's memo is a copy of this one.
                memo=kopf.Memo(
                    max_calls_in_flight=args.max_calls_in_flight,
                    router_cluster_role=router_role,
                    operator_peer=OperatorPeer(args.operator_namespace, args.operator_pod_labels),
                ),
            )
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpilot operator", description=__doc__)
    add_arguments(p)
    # `kvpilot --log-level L operator` (or `kvpilot operator --log-level L`) sets it through kvpilot.cli.main.
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return start(args)


def start(args: argparse.Namespace) -> int:
    """`run` once the Kubernetes credentials load; a missing or broken kubeconfig is one line and exit 2."""
    from kvpilot.kube.kubeconfig import KubeconfigError, fail, load

    try:
        load()
    except KubeconfigError as exc:
        return fail(exc)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
