"""`kvpilot weights update NAME --path P --version V [--adapter A] [--wait]`: create a WeightUpdate and follow
it (with --adapter, of that LoRA adapter: P is its peft directory).

Wiring (kvpilot/cli/main.py): `_COMMANDS["weights"] = add_weights_parser`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from kvpilot.cli.flags import add_command
from kvpilot.operator.cli import _add_target, add_timeout_seconds, create_for_fleet, fleet_object
from kvpilot.operator.cli_follow import Followed
from kvpilot.operator.fleets.builders import WEIGHT_UPDATES
from kvpilot.operator.specs import ROLLING_MAX_UNAVAILABLE, WeightUpdateSpec

DONE = ("Succeeded", "Failed", "Degraded")
UPDATE_TIMEOUT_S = WeightUpdateSpec.default("timeout_seconds")


def add_weights_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("weights", help="weight updates of an InferenceDeployment (WeightUpdate)")
    sub = p.add_subparsers(dest="weights_command", metavar="ACTION", required=True)
    u = add_command(sub, "update", _run_update)
    _add_target(u)
    u.add_argument("--path", required=True, help="checkpoint directory as every pod sees it")
    u.add_argument(
        "--adapter",
        default=None,
        metavar="NAME",
        help="update this LoRA adapter to the peft directory --path instead of the model (spec.adapter)",
    )
    u.add_argument("--version", required=True, dest="weight_version", help="the weight version afterwards")
    # Unset flags stay out of the spec: the API server fills in the CRD's defaults, which the help names.
    strategy, pause_mode = WeightUpdateSpec.default("strategy"), WeightUpdateSpec.default("pause_mode")
    u.add_argument("--strategy", choices=("Atomic", "Rolling"), default=None, help=f"default {strategy}")
    u.add_argument(
        "--pause-mode", choices=("abort", "wait", "keep"), default=None, help=f"default {pause_mode}"
    )
    u.add_argument(
        "--max-unavailable",
        type=int,
        default=None,
        help=f"Rolling: pods at a time (default {ROLLING_MAX_UNAVAILABLE})",
    )
    add_timeout_seconds(u, "the update", UPDATE_TIMEOUT_S)
    u.add_argument("--wait", action="store_true", help="follow the update until it ends, pod by pod")
    u.add_argument(
        "--timeout", type=float, default=None, help="with --wait: stop waiting after this many seconds"
    )


def update_body(name: str, args: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = {"targetRef": {"name": name}, "version": args.weight_version}
    if args.adapter is None:
        spec["modelPath"] = args.path
    else:
        spec["adapter"] = {"name": args.adapter, "path": args.path}
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


def _progress(st: dict[str, Any]) -> str:
    return f"{st['progress']} pods on {st.get('version')}" if st.get("progress") else ""


def _pod_key(p: dict[str, Any], done: bool) -> str | None:
    """A pod's line each time its result or the version it serves moves."""
    return None if p.get("result") == "Pending" else f"{p.get('result')}/{p.get('version', '')}"


UPDATE = Followed("WeightUpdate", WEIGHT_UPDATES, DONE, _progress, _pod_key, describe_pod, WeightUpdateSpec)


def _run_update(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Update an InferenceDeployment's weights (creates a WeightUpdate).

    Create a WeightUpdate for InferenceDeployment NAME; with --wait, show each pod's progress and exit 0 when
    it Succeeded, 1 when it Failed or ended Degraded, 2 on an error, 3 when --timeout passed first.
    """
    return create_for_fleet(args, update_body(args.name, args), UPDATE, out)
