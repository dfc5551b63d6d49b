"""`kvpilot weights update NAME --path P --version V [--wait]`: create a WeightUpdate and follow it.

Wiring (kvpilot/cli.py): `_COMMANDS["weights"] = add_weights_parser`.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

from kvpilot.config_flags import add_command
from kvpilot.operator.builders import GROUP, VERSION, WEIGHT_UPDATES
from kvpilot.operator.cli import _add_target, _api_error, create_for_fleet, fleet_object

DONE = ("Succeeded", "Failed", "Degraded")


def add_weights_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("weights", help="weight updates of an InferenceDeployment (WeightUpdate)")
    sub = p.add_subparsers(dest="weights_command", metavar="ACTION", required=True)
    u = add_command(sub, "update", _run_update)
    _add_target(u)
    u.add_argument("--path", required=True, help="checkpoint directory as every pod sees it")
    u.add_argument("--version", required=True, dest="weight_version", help="the weight version afterwards")
    u.add_argument("--strategy", choices=("Atomic", "Rolling"), default=None, help="default Atomic")
    u.add_argument("--pause-mode", choices=("abort", "wait", "keep"), default=None, help="default wait")
    u.add_argument("--max-unavailable", type=int, default=None, help="Rolling: pods at a time (default 1)")
    u.add_argument("--timeout-seconds", type=int, default=None, help="deadline of the update (default 600)")
    u.add_argument("--wait", action="store_true", help="follow the update until it ends, pod by pod")
    u.add_argument(
        "--timeout", type=float, default=None, help="with --wait: stop waiting after this many seconds"
    )


def update_body(name: str, args: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "targetRef": {"name": name},
        "modelPath": args.path,
        "version": args.weight_version,
    }
    optional = {
        "strategy": args.strategy,
        "pauseMode": args.pause_mode,
        "maxUnavailable": args.max_unavailable,
        "timeoutSeconds": args.timeout_seconds,
    }
    spec.update((k, v) for k, v in optional.items() if v is not None)
    return fleet_object("WeightUpdate", name, spec)


def describe_pod(p: dict[str, Any]) -> str:
    parts = [f"{p['name']:<40} {p.get('result', '?'):<10}"]
    if p.get("version"):
        parts.append(f"serves {p['version']}")
    if p.get("stagedDigest"):
        parts.append(f"staged {p['stagedDigest'][:19]}")
    if p.get("message"):
        parts.append(p["message"])
    return " ".join(parts)


def _run_update(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Update an InferenceDeployment's weights (creates a WeightUpdate).

    Create a WeightUpdate for InferenceDeployment NAME; with --wait, show each pod's progress and exit 0 when
    it Succeeded, 1 when it Failed or ended Degraded, 2 on an error, 3 when --timeout passed first.
    """
    created = create_for_fleet(args, WEIGHT_UPDATES, update_body(args.name, args), out)
    if isinstance(created, int):
        return created
    api, ns, obj, errors = created
    limit = args.timeout if args.timeout is not None else obj["spec"].get("timeoutSeconds", 600) + 30
    return follow(api, ns, obj["metadata"]["name"], time.monotonic() + limit, out, errors)


def follow(api: Any, ns: str, name: str, until: float, out: TextIO, errors: tuple) -> int:
    """Print the phase when it moves and each pod's line when its result does, until the update ends."""
    shown: dict[str, str] = {}
    last = ""
    while time.monotonic() < until:
        try:
            obj = api.get_namespaced_custom_object(GROUP, VERSION, ns, WEIGHT_UPDATES, name)
        except errors as exc:
            print(f"warning: {_api_error(exc)}; retrying", file=sys.stderr)
            time.sleep(1.0)
            continue
        st = obj.get("status") or {}
        phase = st.get("phase") or "Pending"
        line = f"phase {phase}" + (
            f": {st['progress']} pods on {st.get('version')}" if st.get("progress") else ""
        )
        if line != last:
            print(line, file=out, flush=True)
            last = line
        for p in st.get("pods") or []:
            key = f"{p.get('result')}/{p.get('version', '')}"
            if p.get("result") != "Pending" and shown.get(p["name"]) != key:
                shown[p["name"]] = key
                print("  " + describe_pod(p), file=out, flush=True)
        if phase in DONE:
            cond = next((c for c in st.get("conditions") or [] if c.get("status") == "True"), {})
            print(f"{phase}: {cond.get('reason', '')}: {cond.get('message', '')}", file=out, flush=True)
            return 0 if phase == "Succeeded" else 1
        time.sleep(0.5)
    print(f"error: WeightUpdate {ns}/{name} did not finish before --timeout", file=sys.stderr)
    return 3
