"""`kvpilot operator` and `kvpilot reset NAME [-n NS] [--wait]`.

Wiring (kvpilot/cli.py): `_COMMANDS["operator"] = add_operator_parser; _COMMANDS["reset"] = add_reset_parser`.
Each makes its parser with `kvpilot.config_flags.add_command`, which sets the `handler` that
`kvpilot.cli.main` calls with the parsed args.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

from kvpilot.config_flags import add_command
from kvpilot.operator.builders import FLEETS, GROUP, RESETS, VERSION


def add_operator_parser(subparsers: argparse._SubParsersAction) -> None:
    from kvpilot.operator.main import add_arguments

    p = add_command(subparsers, "operator", _run_operator)
    add_arguments(p)


def _run_operator(args: argparse.Namespace) -> int:
    """Run the Kubernetes operator (InferenceDeployment, PrefixCacheReset).

    Run the kvpilot operator (kopf) against the current kubeconfig or in-cluster.
    """
    from kvpilot.operator.main import run

    return run(args)


def add_reset_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "reset", _run_reset)
    p.add_argument("name", metavar="NAME", help="the InferenceDeployment")
    p.add_argument("-n", "--namespace", default=None, help="namespace (default: the kubeconfig context's)")
    p.add_argument(
        "--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)"
    )
    p.add_argument("--wait", action="store_true", help="follow the reset until Complete or Failed")
    p.add_argument("--timeout", type=float, default=None,
                   help="with --wait: give up waiting after this many seconds (default: the reset's "
                   "timeoutSeconds + 30)")  # fmt: skip
    p.add_argument("--reset-running-requests", action="store_true",
                   help="also preempt running requests (no pre-reset KV used afterwards)")  # fmt: skip
    p.add_argument(
        "--timeout-seconds", type=int, default=None, help="deadline of the whole reset (default 60)"
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="pods called at once (default 64)")


def _client(kubeconfig: str | None) -> tuple[Any, str]:
    from kubernetes import client, config

    try:
        config.load_kube_config(config_file=kubeconfig)
        _, ctx = config.list_kube_config_contexts(config_file=kubeconfig)
        ns = (ctx.get("context") or {}).get("namespace") or "default"
    except config.ConfigException:
        config.load_incluster_config()
        ns = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read().strip()
    return client.CustomObjectsApi(), ns


def reset_body(name: str, args: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = {"targetRef": {"name": name}}
    if args.reset_running_requests:
        spec["resetRunningRequests"] = True
    if args.timeout_seconds is not None:
        spec["timeoutSeconds"] = args.timeout_seconds
    if args.max_concurrency is not None:
        spec["maxConcurrency"] = args.max_concurrency
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PrefixCacheReset",
            "metadata": {"generateName": f"{name[:50]}-"}, "spec": spec}  # fmt: skip


def describe_pod(p: dict[str, Any]) -> str:
    parts = [f"{p['name']:<40} {p.get('result', '?'):<12}"]
    if p.get("result") == "Succeeded" and p.get("epoch") is not None:
        parts.append(f"epoch {p['epoch']}, {p.get('evictedBlocks', 0)} blocks evicted")
    elif p.get("message"):
        parts.append(p["message"])
    if p.get("durationSeconds") is not None:
        parts.append(f"({p['durationSeconds']:.3f}s, {p.get('attempts', 0)} attempts)")
    return " ".join(parts)


def _api_error(exc: Exception) -> str:
    from kubernetes.client.rest import ApiException

    if isinstance(exc, ApiException):
        try:
            msg = json.loads(exc.body or "{}").get("message") or exc.reason
        except ValueError:
            msg = exc.reason
        return f"{exc.status} {msg}"
    return f"cannot reach the Kubernetes API: {exc}"


def _run_reset(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Reset the prefix caches of an InferenceDeployment's pods (creates a PrefixCacheReset).

    Create a PrefixCacheReset for InferenceDeployment NAME; with --wait, show progress and each pod that did
    not succeed as it happens, and exit 0 when it Succeeded, 1 when it Failed, 2 on an error (no such
    InferenceDeployment, no cluster), 3 when --timeout passed first.
    """
    import urllib3
    from kubernetes.client.rest import ApiException

    errors = (ApiException, urllib3.exceptions.HTTPError, OSError)
    try:
        api, default_ns = _client(args.kubeconfig)
    except Exception as exc:  # noqa: BLE001 - no kubeconfig and not in a cluster
        print(f"error: no Kubernetes configuration: {exc}", file=sys.stderr)
        return 2
    ns = args.namespace or default_ns
    try:
        api.get_namespaced_custom_object(GROUP, VERSION, ns, FLEETS, args.name)
    except errors as exc:
        if isinstance(exc, ApiException) and exc.status == 404:
            print(f"error: InferenceDeployment {ns}/{args.name} not found", file=sys.stderr)
        else:
            print(f"error: reading InferenceDeployment {ns}/{args.name}: {_api_error(exc)}", file=sys.stderr)
        return 2
    try:
        obj = api.create_namespaced_custom_object(GROUP, VERSION, ns, RESETS, reset_body(args.name, args))
    except errors as exc:
        print(f"error: creating the PrefixCacheReset: {_api_error(exc)}", file=sys.stderr)
        return 2
    name = obj["metadata"]["name"]
    print(f"prefixcachereset.kvpilot.io/{name} created", file=out, flush=True)
    if not args.wait:
        return 0
    limit = args.timeout if args.timeout is not None else obj["spec"].get("timeoutSeconds", 60) + 30
    return _follow(api, ns, name, time.monotonic() + limit, out, errors)


def _follow(api: Any, ns: str, name: str, until: float, out: TextIO, errors: tuple) -> int:
    """Print progress until the reset finishes: counts when they move, each pod that did not succeed."""
    from kubernetes.client.rest import ApiException

    shown: dict[str, str] = {}
    last = ""
    while time.monotonic() < until:
        try:
            obj = api.get_namespaced_custom_object(GROUP, VERSION, ns, RESETS, name)
        except errors as exc:
            if isinstance(exc, ApiException) and exc.status == 404:
                print(f"error: PrefixCacheReset {ns}/{name} was deleted", file=sys.stderr)
                return 2
            print(f"warning: {_api_error(exc)}; retrying", file=sys.stderr)
            time.sleep(1.0)
            continue
        st = obj.get("status") or {}
        phase = st.get("phase") or "Pending"
        line = f"phase {phase}"
        if st.get("targets") is not None:
            line += f": {st.get('progress', '0/0')} pods reset, {st.get('failed', 0)} failed, {st.get('skipped', 0)} skipped"
        if line != last:
            print(line, file=out, flush=True)
            last = line
        done = phase in ("Succeeded", "Failed")
        for p in st.get("pods") or []:
            final = p.get("result") in ("Failed", "Skipped", "NotSupported") or (
                done and p.get("result") == "Succeeded"
            )
            if final and shown.get(p["name"]) != p["result"]:
                shown[p["name"]] = p["result"]
                print("  " + describe_pod(p), file=out, flush=True)
        if done:
            if st.get("podsOmitted"):
                print(f"  ... {st['podsOmitted']} more pods (status keeps 100 entries)", file=out, flush=True)
            cond = next((c for c in st.get("conditions") or [] if c.get("status") == "True"), {})
            print(f"{phase}: {cond.get('reason', '')}: {cond.get('message', '')}", file=out, flush=True)
            return 0 if phase == "Succeeded" else 1
        time.sleep(0.5)
    print(f"error: PrefixCacheReset {ns}/{name} did not finish before --timeout", file=sys.stderr)
    return 3
