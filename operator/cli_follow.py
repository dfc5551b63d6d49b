"""The CLI's API errors as one line, and `--wait` for its resources (a PrefixCacheReset, a WeightUpdate):
poll the object, print its phase when the line moves and each pod's line when its result does, then the
final condition; one loop for both, each resource saying what its lines hold (`Followed`)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from kvpilot.operator.fleets.builders import GROUP, VERSION
from kvpilot.operator.specs import ResetSpec, WeightUpdateSpec


@dataclass(frozen=True)
class Followed:
    kind: str  # as users name it in messages: PrefixCacheReset
    plural: str
    done: tuple[str, ...]  # phases it ends in; the first is the success
    progress: Callable[[dict[str, Any]], str]  # status -> what follows "phase X" ("" for nothing)
    # (pod entry, finished) -> a key that changes when the pod's line should be printed again; None: not yet.
    pod_key: Callable[[dict[str, Any], bool], str | None]
    describe_pod: Callable[[dict[str, Any]], str]
    spec: type[ResetSpec | WeightUpdateSpec]  # its spec, typed: --wait's default limit is its timeoutSeconds
    # conditions shown whatever their status, before the final line (a reset's Verified)
    reported: tuple[str, ...] = ()


def api_error(exc: Exception) -> str:
    """One line for a failed API call: the API server's own message, or why it could not be reached."""
    from kubernetes.client.exceptions import ApiException

    if isinstance(exc, ApiException):
        try:
            msg = json.loads(exc.body or "{}").get("message") or exc.reason
        except ValueError:
            msg = exc.reason
        return f"{exc.status} {msg}"
    return f"cannot reach the Kubernetes API: {exc}"


def follow(
    api: Any,
    ns: str,
    name: str,
    what: Followed,
    until: float,
    out: TextIO,
    errors: tuple[type[Exception], ...],
) -> int:
    """Exit code: 0 the success phase, 1 another final phase, 2 the object was deleted, 3 `until` passed."""
    from kubernetes.client.exceptions import ApiException

    shown: dict[str, str] = {}
    last = ""
    while time.monotonic() < until:
        try:
            obj = api.get_namespaced_custom_object(GROUP, VERSION, ns, what.plural, name)
        except errors as exc:
            if isinstance(exc, ApiException) and exc.status == 404:
                print(f"error: {what.kind} {ns}/{name} was deleted", file=sys.stderr)
                return 2
            print(f"warning: {api_error(exc)}; retrying", file=sys.stderr)
            time.sleep(1.0)
            continue
        st = obj.get("status") or {}
        phase = st.get("phase") or "Pending"
        progress = what.progress(st)
        line = f"phase {phase}" + (f": {progress}" if progress else "")
        if line != last:
            print(line, file=out, flush=True)
            last = line
        done = phase in what.done
        for p in st.get("pods") or []:
            key = what.pod_key(p, done)
            if key is not None and shown.get(p["name"]) != key:
                shown[p["name"]] = key
                print("  " + what.describe_pod(p), file=out, flush=True)
        if done:
            if st.get("podsOmitted"):
                print(f"  ... {st['podsOmitted']} more pods (status keeps 100 entries)", file=out, flush=True)
            conds = st.get("conditions") or []
            for c in conds:
                if c.get("type") in what.reported:
                    print(
                        f"{c['type']} {c.get('status')}: {c.get('reason', '')}: {c.get('message', '')}",
                        file=out,
                    )
            ended = [c for c in conds if c.get("status") == "True" and c.get("type") not in what.reported]
            cond = ended[0] if ended else {}
            print(f"{phase}: {cond.get('reason', '')}: {cond.get('message', '')}", file=out, flush=True)
            return 0 if phase == what.done[0] else 1
        time.sleep(0.5)
    print(f"error: {what.kind} {ns}/{name} did not finish before --timeout", file=sys.stderr)
    return 3
