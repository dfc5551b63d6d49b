"""`kvpilot operator`, `kvpilot reset NAME [-n NS] [--wait]` and `kvpilot endpoint NAME [-n NS]`.

Wiring (kvpilot/cli/main.py): `_COMMANDS["operator"] = add_operator_parser; _COMMANDS["reset"] = add_reset_parser;
_COMMANDS["endpoint"] = add_endpoint_parser`.
Each makes its parser with `kvpilot.cli.flags.add_command`, which sets the `handler` that
`kvpilot.cli.main.main` calls with the parsed args.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from typing import Any, TextIO, cast

from kvpilot.cli.flags import add_command
from kvpilot.kube.kubeconfig import KubeconfigError, fail, load
from kvpilot.operator.cli_follow import Followed, api_error, follow
from kvpilot.operator.fleets.builders import FLEETS, GROUP, RESETS, VERSION
from kvpilot.operator.fleets.status import fleet_status
from kvpilot.operator.specs import ResetSpec

RESET_TIMEOUT_S = ResetSpec.default("timeout_seconds")


def add_operator_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvpilot.operator.main import add_arguments

    p = add_command(subparsers, "operator", _run_operator)
    add_arguments(p)


def _run_operator(args: argparse.Namespace) -> int:
    """Run the Kubernetes operator (InferenceDeployment, PrefixCacheReset).

    Run the kvpilot operator (kopf) against the current kubeconfig or in-cluster.
    """
    from kvpilot.operator.main import start

    return start(args)


def _add_target(p: argparse.ArgumentParser) -> None:
    """NAME, -n and --kubeconfig: the InferenceDeployment a command is about."""
    p.add_argument("name", metavar="NAME", help="the InferenceDeployment")
    p.add_argument("-n", "--namespace", default=None, help="namespace (default: the kubeconfig context's)")
    p.add_argument(
        "--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)"
    )


def add_reset_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(subparsers, "reset", _run_reset)
    _add_target(p)
    p.add_argument("--wait", action="store_true", help="follow the reset until Complete or Failed")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="with --wait: give up waiting after this many seconds (default: the reset's "
        "timeoutSeconds + 30)",
    )
    p.add_argument(
        "--reset-running-requests",
        action="store_true",
        help="also preempt running requests (no pre-reset KV used afterwards)",
    )
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip the canary that proves each pod cold (spec.verify: false)",
    )
    p.add_argument(
        "--no-reset-external",
        dest="reset_external",
        action="store_false",
        help="vLLM: leave its CPU offload tier and KV connectors as they are (spec.resetExternal: false)",
    )
    for flag, what in (
        ("--lora-name", "one LoRA adapter's blocks (every version of it)"),
        ("--cache-salt", "one cache_salt's blocks"),
        ("--weight-version", "one weight version's blocks ('initial': the weights the pods started with)"),
    ):
        p.add_argument(flag, default=None, help=f"reset only {what}; the rest stays warm (spec.scope)")
    add_timeout_seconds(p, "the whole reset", RESET_TIMEOUT_S)
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help=f"pods called at once (default {ResetSpec.default('max_concurrency')})",
    )


def add_timeout_seconds(p: argparse.ArgumentParser, what: str, default: int) -> None:
    """--timeout-seconds, the spec's timeoutSeconds. Unset flags stay out of a spec: the API server fills in
    the CRD's defaults, which the help names (from kvpilot.operator.specs)."""
    p.add_argument(
        "--timeout-seconds", type=int, default=None, help=f"deadline of {what} (default {default})"
    )


def reset_body(name: str, args: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = {"targetRef": {"name": name}}
    if args.reset_running_requests:
        spec["resetRunningRequests"] = True
    if not args.verify:
        spec["verify"] = False
    if not args.reset_external:
        spec["resetExternal"] = False
    if args.timeout_seconds is not None:
        spec["timeoutSeconds"] = args.timeout_seconds
    if args.max_concurrency is not None:
        spec["maxConcurrency"] = args.max_concurrency
    scope = {
        field: value
        for field, value in (
            ("loraName", args.lora_name),
            ("cacheSalt", args.cache_salt),
            ("weightVersion", args.weight_version),
        )
        if value is not None
    }
    if scope:
        spec["scope"] = scope
    return fleet_object("PrefixCacheReset", name, spec)


def fleet_object(kind: str, fleet: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A new resource of ours about InferenceDeployment `fleet`, named after it (generateName `FLEET-`)."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": kind,
        "metadata": {"generateName": f"{fleet[:50]}-"},
        "spec": spec,
    }


def describe_pod(p: dict[str, Any]) -> str:
    parts = [f"{p['name']:<40} {p.get('result', '?'):<12}"]
    if p.get("result") == "Succeeded" and p.get("epoch") is not None:
        parts.append(f"epoch {p['epoch']}, {p.get('evictedBlocks', 0)} blocks evicted")
    elif p.get("message"):
        parts.append(p["message"])
    if p.get("durationSeconds") is not None:
        parts.append(f"({p['durationSeconds']:.3f}s, {p.get('attempts', 0)} attempts)")
    verified = p.get("verified")
    if verified == "unknown":  # why it could not be verified; a warm pod's message already says what served
        parts.append(f"verified unknown: {p.get('verification', '')}")
    elif verified:
        parts.append(f"verified {verified}")
    return " ".join(parts)


def _reset_progress(st: dict[str, Any]) -> str:
    if st.get("targets") is None:
        return ""
    line = f"{st.get('progress', '0/0')} pods reset, {st.get('failed', 0)} failed, {st.get('skipped', 0)} skipped"
    verified = st.get("verified")
    return line + (f", {verified} verified cold" if verified and verified != "off" else "")


def _reset_pod_key(p: dict[str, Any], done: bool) -> str | None:
    """A pod's line as soon as it did not succeed; the successes only at the end."""
    final = p.get("result") in ("Failed", "Skipped", "NotSupported") or (
        done and p.get("result") == "Succeeded"
    )
    return p["result"] if final else None


RESET = Followed(
    "PrefixCacheReset",
    RESETS,
    ("Succeeded", "Failed"),
    _reset_progress,
    _reset_pod_key,
    describe_pod,
    ResetSpec,
    reported=("Verified",),
)


def _run_reset(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Reset the prefix caches of an InferenceDeployment's pods (creates a PrefixCacheReset).

    Create a PrefixCacheReset for InferenceDeployment NAME; with --wait, show progress and each pod that did
    not succeed as it happens, and exit 0 when it Succeeded, 1 when it Failed, 2 on an error (no such
    InferenceDeployment, no cluster), 3 when --timeout passed first.
    """
    return create_for_fleet(args, reset_body(args.name, args), RESET, out)


def create_for_fleet(args: argparse.Namespace, body: dict[str, Any], what: Followed, out: TextIO) -> int:
    """Create `body` (a resource about InferenceDeployment args.name) and say so; with --wait, follow it until
    it ends or --timeout (default: its spec.timeoutSeconds, as the API server defaulted it, plus 30 s) passes. The
    exit code: 0 created (or Succeeded), 2 an error (said on stderr), else what `follow` returns."""
    import urllib3
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    errors = (ApiException, urllib3.exceptions.HTTPError, OSError)
    try:
        default_ns = load(args.kubeconfig)
    except KubeconfigError as exc:
        return fail(exc)
    ns = args.namespace or default_ns
    api = client.CustomObjectsApi()
    if _read_fleet(api, ns, args.name) is None:
        return 2
    try:
        obj = cast(  # the decoded JSON object
            dict[str, Any], api.create_namespaced_custom_object(GROUP, VERSION, ns, what.plural, body)
        )
    except errors as exc:
        print(f"error: creating the {body['kind']}: {api_error(exc)}", file=sys.stderr)
        return 2
    print(f"{body['kind'].lower()}.{GROUP}/{obj['metadata']['name']} created", file=out, flush=True)
    if not args.wait:
        return 0
    limit = args.timeout if args.timeout is not None else what.spec.parse(obj["spec"]).timeout_seconds + 30
    return follow(api, ns, obj["metadata"]["name"], what, time.monotonic() + limit, out, errors)


def _read_fleet(api: Any, ns: str, name: str) -> dict[str, Any] | None:
    """The InferenceDeployment; None after saying on stderr why there is none."""
    import urllib3
    from kubernetes.client.exceptions import ApiException

    try:
        fleet = api.get_namespaced_custom_object(GROUP, VERSION, ns, FLEETS, name)
        return cast(dict[str, Any], fleet)  # the decoded JSON object
    except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
        if isinstance(exc, ApiException) and exc.status == 404:
            print(f"error: InferenceDeployment {ns}/{name} not found", file=sys.stderr)
        else:
            print(f"error: reading InferenceDeployment {ns}/{name}: {api_error(exc)}", file=sys.stderr)
        return None


def add_endpoint_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(subparsers, "endpoint", _run_endpoint)
    _add_target(p)
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--in-cluster",
        dest="where",
        action="store_const",
        const="cluster",
        help="print status.endpoint, the Service's DNS name (for clients in a pod)",
    )
    where.add_argument(
        "--from-host",
        dest="where",
        action="store_const",
        const="host",
        help="print the address of a ready pod behind that Service (for clients outside the "
        "cluster network that can reach pod IPs, as on the dev cluster)",
    )


def _run_endpoint(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Print a URL of an InferenceDeployment that works from here: the router's, else the fleet's.

    Where the Service's DNS name resolves (in a pod): status.endpoint, http://NAME-router.NS.svc:8080 with the
    router on, else http://NAME.NS.svc:PORT. Where it does not (outside the cluster; the dev cluster has no
    DNS or kube-proxy at all): the address of a ready pod behind that Service, a router pod when the router is
    on, else a daemon pod; stderr says which. --in-cluster or --from-host decides instead of the DNS lookup.
    Exit 0 with the URL on stdout, 1 when there is none yet (no status.endpoint, no ready pod), 2 on an error.
    """
    from urllib.parse import urlsplit

    from kubernetes import client

    from kvpilot.kube.endpointslices import MANAGED_BY, SERVICE_LABEL, ready_endpoints

    try:
        default_ns = load(args.kubeconfig)
    except KubeconfigError as exc:
        return fail(exc)
    ns = args.namespace or default_ns
    if (obj := _read_fleet(client.CustomObjectsApi(), ns, args.name)) is None:
        return 2
    endpoint = fleet_status(obj).get("endpoint")
    if not endpoint:
        print(
            f"error: InferenceDeployment {ns}/{args.name} has no status.endpoint yet: is the operator running "
            "(`kvpilot operator`, or the Helm chart's)?",
            file=sys.stderr,
        )
        return 1
    host = urlsplit(endpoint).hostname or ""
    if (args.where or ("cluster" if _resolves(host) else "host")) == "cluster":
        print(endpoint, file=out)
        return 0
    service = host.split(".")[0]  # NAME-router or NAME: the Service behind status.endpoint
    try:
        slices = client.DiscoveryV1Api().list_namespaced_endpoint_slice(
            # Only the endpointslice controller's slices (a hand-made one could name any address), and a
            # bounded page of them: one ready pod is all this prints.
            ns,
            label_selector=f"{SERVICE_LABEL}={service},{MANAGED_BY}",
            limit=20,
        )
    except Exception as exc:  # noqa: BLE001 - ApiException or no answer: one line either way
        print(
            f"error: reading the EndpointSlices of Service {ns}/{service}: {api_error(exc)}", file=sys.stderr
        )
        return 2
    pods = ready_endpoints(client.ApiClient().sanitize_for_serialization(slices.items))
    if not pods:
        print(
            f"error: no ready pod behind Service {ns}/{service} yet; wait with `kubectl wait "
            f"--for=condition=Ready infd/{args.name} -n {ns}`",
            file=sys.stderr,
        )
        return 1
    kind = "daemon" if service == args.name else "router"
    print(
        f"{host} does not resolve here (outside the cluster): this is {kind} pod {pods[0].name}'s address; "
        f"in a pod use {endpoint}",
        file=sys.stderr,
    )
    print(pods[0].url, file=out)
    return 0


def _resolves(host: str) -> bool:
    """Whether this machine can resolve `host`: a Service's name resolves in a pod, not on the host."""
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    return True
